"""Multimodal and LoRA prefixes in the router's hashes: request side and event side agree, images separate.

vLLM's per-block keys are checked against vLLM's own output (tests/fixtures/vllm/hash_extra_keys.json, made by
vLLM's `generate_block_hash_extra_keys`): the router derives its keys with the same walk, so an image shares
blocks exactly where vLLM would share them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router import BlockHashError, KvIndex, RouteRequest, Router, build_policy
from router.hashing import block_hashes
from router.mm_hashing import block_mm_keys, mm_block_hashes, mm_block_hashes_view
from router.kv_events import BlockStored
from workers.vllm.kv_events import decode_payload, encode_batch

GOLDEN = json.loads((Path(__file__).resolve().parents[2] / "fixtures" / "vllm" / "hash_extra_keys.json").read_text())


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=[c["name"] for c in GOLDEN["cases"]])
def test_block_keys_are_vllms_mm_keys(case):
    want = [tuple((k[1], k[2]) for k in keys if k[0] == "mm") or None if keys else None for keys in case["extra_keys"]]
    got = block_mm_keys(case["tokens"], case["block_size"], [tuple(i) for i in case.get("mm", [])])
    assert got == want


def test_without_keys_the_chain_is_the_text_chain():
    t = list(range(100, 260))
    assert mm_block_hashes(t, 16) == block_hashes(t, 16)
    assert mm_block_hashes(t, 16, "ad") == block_hashes(t, 16, "ad")
    assert mm_block_hashes(t[48:], 16, parent=block_hashes(t, 16)[2]) == block_hashes(t, 16)[3:]
    assert list(mm_block_hashes_view(t, 16, None, ())) == block_hashes(t, 16)


def test_same_image_shares_different_image_never_text_prefix_still_matches():
    ph = [9] * 40
    text = list(range(1000, 1020))
    prompt = text + ph + list(range(2000, 2030))
    img1, img2 = [("img-1", 20, 40)], [("img-2", 20, 40)]
    a = list(mm_block_hashes_view(prompt, 16, None, img1))
    b = list(mm_block_hashes_view(prompt, 16, None, img1))
    c = list(mm_block_hashes_view(prompt, 16, None, img2))
    plain = block_hashes(prompt, 16)
    assert a == b
    assert c[0] == a[0] == plain[0]  # block 0 is text only: shared by every prompt with that text
    assert not set(c[1:]) & set(a[1:])  # from the first block the image covers, nothing is shared
    assert not set(a[1:]) & set(plain)  # and an image never matches its bare placeholder tokens
    moved = list(mm_block_hashes_view(list(range(1000, 1022)) + ph + list(range(2000, 2028)), 16, None, [("img-1", 22, 40)]))
    assert moved[1] != a[1]  # the same image two tokens later keys its blocks differently (as vLLM does)
    assert list(mm_block_hashes_view(prompt, 16, "ad", img1)) != a  # the adapter seeds the chain too


def test_event_with_mm_keys_indexes_what_the_request_hashes(impl):
    """A vLLM BlockStored carrying (identifier, offset) extra keys, through the wire codec, lands on the hashes a
    request with the same image computes; the other image's request matches only the text block."""
    ph = [9] * 40
    prompt = list(range(1000, 1020)) + ph + list(range(2000, 2036))  # 96 tokens: 6 blocks
    items = (("img-1", 20, 40),)
    keys = block_mm_keys(len(prompt), 16, items)
    ev = BlockStored(block_hashes=[101, 102, 103, 104, 105, 106], parent_block_hash=None, token_ids=prompt, block_size=16,
                     lora_name="ad", mm_keys=keys)
    wire = encode_batch(1.0, [ev])
    back = decode_payload(wire).events[0]
    assert back.mm_keys == keys and back.lora_name == "ad"
    r = Router(build_policy("kv", seed=0))
    r.kv_index.apply("w0", back)
    hit = RouteRequest("a", "m", list(prompt) + [5] * 3, lora_name="ad", mm_items=items)
    miss = RouteRequest("b", "m", list(prompt), lora_name="ad", mm_items=(("img-2", 20, 40),))
    base = RouteRequest("c", "m", list(prompt), mm_items=items)
    r._match_prefix(hit, 16)
    r._match_prefix(miss, 16)
    r._match_prefix(base, 16)
    assert hit.overlap_blocks == {"w0": 6}
    assert miss.overlap_blocks == {"w0": 1}
    assert base.overlap_blocks == {}  # the adapter's blocks are not the base model's


def test_mm_event_chains_from_a_parent():
    ph = [9] * 40
    prompt = list(range(1000, 1020)) + ph + list(range(2000, 2036))
    keys = block_mm_keys(len(prompt), 16, [("x", 20, 40)])
    idx = KvIndex()
    idx.store("w", [1, 2], None, prompt[:32], 16, None, keys[:2])
    idx.store("w", [3, 4, 5, 6], 2, prompt[32:], 16, None, keys[2:])
    assert idx.find_matches(list(mm_block_hashes_view(prompt, 16, None, [("x", 20, 40)]))) == {"w": 6}


def test_bad_inputs_raise_block_hash_errors():
    with pytest.raises(BlockHashError):
        mm_block_hashes([1, -1] * 8, 16, keys=[(("x", 0),)])
    with pytest.raises(BlockHashError):
        mm_block_hashes_view([1] * 16, 0, None, ())


def test_malformed_extra_keys_are_refused_not_crashing():
    from router.kv_events import KvEventDecodeError
    from workers.vllm.kv_events import decode_mm_keys

    assert decode_mm_keys([None, ["ad"]], 2) is None  # a LoRA name only: no multimodal keys
    assert decode_mm_keys([["ad", ["img", 3]], None], 2) == [(("img", 3),), None]
    for bad in ("x", [1], [None, None, None]):
        with pytest.raises(KvEventDecodeError):
            decode_mm_keys(bad, 2)
