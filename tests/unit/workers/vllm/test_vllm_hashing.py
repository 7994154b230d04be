"""Recomputing vLLM 0.32's published block hashes (sha256 + pickle, seed "vllm-none-hash")."""

from __future__ import annotations

import hashlib
import pickle

import pytest

from router.kv_events import BlockStored
from workers.vllm.hashing import none_hash, to_external, vllm_block_digests, vllm_block_hashes
from workers.vllm.kv_events import decode_pub_frames


def _stored(kv_golden):
    for step in kv_golden["steps"]:
        for msg in step["messages"]:
            for ev in decode_pub_frames([bytes.fromhex(f) for f in msg]).events:
                if isinstance(ev, BlockStored):
                    yield step, ev


def test_first_block_formula_by_hand():
    seed = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    tokens = list(range(3, 35))
    digest = hashlib.sha256(pickle.dumps((seed, tuple(tokens), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert vllm_block_hashes(tokens, 32) == [int.from_bytes(digest, "big") & (2**64 - 1)]


def test_every_captured_root_event_recomputes(kv_golden):
    """Events with no parent start at NONE_HASH, so their token_ids alone determine their hashes."""
    roots = [ev for _, ev in _stored(kv_golden) if ev.parent_block_hash is None]
    assert len(roots) >= 5
    for ev in roots:
        assert vllm_block_hashes(ev.token_ids, ev.block_size) == ev.block_hashes


def test_captured_prompts_recompute_including_the_chained_prefix(kv_golden):
    for step, ev in _stored(kv_golden):
        prompt = step.get("prompt_token_ids")
        if prompt is None:
            continue
        full = vllm_block_hashes(prompt, 32)
        assert ev.block_hashes == full[len(full) - len(ev.block_hashes) :]
        if ev.parent_block_hash is not None:
            assert ev.parent_block_hash == full[len(full) - len(ev.block_hashes) - 1]


def test_only_full_blocks_are_hashed_and_the_chain_is_prefix_stable():
    toks = list(range(3, 3 + 100))
    assert len(vllm_block_hashes(toks, 32)) == 3
    assert vllm_block_hashes(toks[:64], 32) == vllm_block_hashes(toks, 32)[:2]
    assert vllm_block_hashes(toks[:31], 32) == []


def test_seed_and_extra_keys_change_the_chain():
    toks = list(range(3, 67))
    base = vllm_block_hashes(toks, 32)
    assert vllm_block_hashes(toks, 32, seed="0") != base
    salted = vllm_block_hashes(toks, 32, extra_keys=[("cache_salt", "s"), None])
    assert salted[0] != base[0] and salted[1] != base[1]  # the salt flows down the chain


def test_digests_and_external_form():
    digests = vllm_block_digests(list(range(64)), 32)
    assert all(len(d) == 32 for d in digests)
    assert [to_external(d) for d in digests] == vllm_block_hashes(list(range(64)), 32)
    assert len(none_hash()) == 32


def test_bad_block_size():
    with pytest.raises(ValueError):
        vllm_block_hashes([1, 2], 0)
