"""vLLM 0.32's block extra keys (LoRA, multimodal, cache salt) and the hashes they give, against vLLM's own output.

The golden values come from vLLM's `get_request_block_hasher` / `generate_block_hash_extra_keys` /
`to_event_extra_keys` (tests/fixtures/vllm/hash_extra_keys.py says how they were made;
tests/integration/test_vllm_hash_golden.py checks them against the installed vLLM).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.vllm.hashing import to_event_extra_keys, vllm_block_hashes, vllm_extra_keys

GOLDEN = json.loads((Path(__file__).resolve().parents[3] / "fixtures" / "vllm" / "hash_extra_keys.json").read_text())
CASES = GOLDEN["cases"]


def tokens_of(case: dict) -> list[int]:
    return [(7 * i + 11) % 997 + 3 for i in range(case["tokens"])]


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def ours(case: dict) -> list:
    return vllm_extra_keys(case["tokens"], case["block_size"], lora=tuple(case["lora"]) if case.get("lora") else None,
                           mm_items=[tuple(i) for i in case.get("mm", [])], cache_salt=case.get("salt"))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_extra_keys_are_vllms(case: dict) -> None:
    assert ours(case) == [_tuples(k) for k in case["extra_keys"]]
    assert (to_event_extra_keys(ours(case)) or [None] * len(case["extra_keys"])) == [_tuples(k) for k in case["event_extra_keys"]]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_block_hashes_are_vllms(case: dict) -> None:
    assert vllm_block_hashes(tokens_of(case), case["block_size"], extra_keys=ours(case)) == case["block_hashes"]


def test_golden_cases_tell_apart_what_they_should() -> None:
    by = {c["name"]: c["block_hashes"] for c in CASES}
    assert by["lora"] != by["text"] and by["lora"] != by["lora-other-path"]  # the adapter's path is in the key
    # the image covers blocks 0-2: the two images share nothing; the same image shifted by 2 tokens shares nothing
    assert not set(by["one-image"]) & set(by["other-image"])
    assert not set(by["one-image"]) & set(by["image-shifted"])
