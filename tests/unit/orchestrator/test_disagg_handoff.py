"""The per-engine request transforms (workers/*/handoff.py): pure, so checked on literals."""

from __future__ import annotations

import random

import pytest

from workers.sglang import handoff as sglang
from workers.trtllm import handoff as trtllm
from workers.vllm import handoff as vllm


def test_vllm_prefill_body_does_not_touch_the_original():
    body = {"model": "m", "prompt": "p", "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 3, "max_tokens": 9}
    out = vllm.prefill_body(body, chat=False)
    assert out == {"model": "m", "prompt": "p", "stream": False, "max_tokens": 1, "kv_transfer_params": vllm.PREFILL_KV_TRANSFER_PARAMS}
    assert body["stream"] is True and body["max_tokens"] == 9 and "kv_transfer_params" not in body
    out["kv_transfer_params"]["do_remote_decode"] = False
    assert vllm.PREFILL_KV_TRANSFER_PARAMS["do_remote_decode"] is True  # each body gets its own copy


@pytest.mark.parametrize("resp", [{}, {"kv_transfer_params": None}, {"kv_transfer_params": {"do_remote_prefill": True}}, []])
def test_vllm_missing_handoff_is_an_error(resp):
    with pytest.raises(ValueError):
        vllm.kv_transfer_params_of(resp)


def test_sglang_room_range_and_body():
    rooms = [sglang.new_room(random.Random(i)) for i in range(200)]
    assert all(0 <= r <= 2**63 - 1 for r in rooms) and len(set(rooms)) == 200
    assert sglang.bootstrap_body({"a": 1}, "h", 9, 5) == {"a": 1, "bootstrap_host": "h", "bootstrap_port": 9, "bootstrap_room": 5}


def test_trtllm_generation_needs_the_context_state():
    ctx = {"choices": [{"finish_reason": "length", "disaggregated_params": {"request_type": "context_only", "ctx_request_id": 4}}],
           "prompt_token_ids": [1, 2]}
    assert not trtllm.context_finished(ctx)
    gen = trtllm.generation_body({"model": "m", "prompt": "hi"}, ctx, chat=False)
    assert gen == {"model": "m", "prompt": [1, 2], "disaggregated_params": {"request_type": "generation_only", "ctx_request_id": 4}}
    assert trtllm.context_finished({"choices": [{"finish_reason": "stop"}]})
    for bad in ({"choices": []}, {"choices": [{"finish_reason": "length"}], "prompt_token_ids": [1]},
                {"choices": [{"finish_reason": "length", "disaggregated_params": {}}]}):
        with pytest.raises(ValueError):
            trtllm.generation_body({"model": "m", "prompt": "hi"}, bad, chat=False)


def test_vllm_prefix_addressed_connector_hands_off_nothing() -> None:
    """ExampleConnector/LMCache: the prefill answers kv_transfer_params null; decode gets the body unchanged."""
    from workers.vllm import handoff as vh

    answer = {"choices": [{"text": "x"}], "kv_transfer_params": None}
    assert vh.kv_transfer_params_of(answer, prefix_addressed=True) is None
    with pytest.raises(ValueError):  # a NIXL-style connector must hand something off
        vh.kv_transfer_params_of(answer)
    body = {"model": "m", "prompt": [1, 2, 3], "stream": True}
    assert vh.decode_body(body, None) == body and vh.decode_body(body, None) is not body
    assert "ExampleConnector" in vh.PREFIX_ADDRESSED_CONNECTORS and "NixlConnector" not in vh.PREFIX_ADDRESSED_CONNECTORS
