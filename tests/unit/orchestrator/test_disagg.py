"""Disaggregated prefill/decode through the whole frontend, against fake engines of each flavor.

For each hand-off protocol: the exact bodies sent to prefill and decode (golden), the streamed and
unary results, fallback on a failed / slow / lost / malformed prefill, enforce-disagg's 503,
conditional local prefill, cancellation reaching both sides, and the routers' books closed on
every path.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from orchestrator.app import create_app
from orchestrator.config import DisaggConfig, FrontendConfig
from workers.discovery import InMemoryDiscovery
from workers.sim.backend import SIM_TOKENIZER_DIR as TOKENIZER_DIR
from workers.types import WorkerInfo, WorkerRole

from orchestrator.testing import FakePDEngine, HandoffBook, free_port

VLLM_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
                       "remote_host": None, "remote_port": None}
LONG = "the quick brown fox jumps over the lazy dog " * 12  # ~110 tokens: prefilled remotely by default


def winfo(wid: str, url: str, role: str, proto: str, bootstrap_port: int | None = None) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, model="m", backend="sim", role=WorkerRole(role), url=url, block_size=16, max_model_len=4096,
                      tokenizer=str(TOKENIZER_DIR), pd_protocol=proto, bootstrap_port=bootstrap_port)


class Stack:
    def __init__(self, app, client: httpx.AsyncClient, disc: InMemoryDiscovery) -> None:
        self.app, self.client, self.disc = app, client, disc
        self.service = app.state.service

    async def add(self, *infos: WorkerInfo) -> None:
        for i in infos:
            await self.disc.register(i, ttl_s=60)
        await self.app.state.pool.refresh()

    def decisions(self, mode: str, reason: str) -> float:
        v = self.app.state.metrics.registry.get_sample_value("kvyard_disagg_decisions_total", {"mode": mode, "reason": reason})
        return v or 0.0

    def books_closed(self) -> bool:
        """No request left on any worker, in the service's (aggregated + decode) and the prefill load book."""
        loads = list(self.app.state.router.loads._loads.values()) + list(self.service.disagg.prefill_router.loads._loads.values())
        return all(ld.inflight_requests == 0 and ld.prefill_tokens == 0 and ld.active_blocks == 0 for ld in loads)


@pytest.fixture
async def stack(request):
    disagg = getattr(request, "param", None) or DisaggConfig()
    disc = InMemoryDiscovery()
    app = create_app(FrontendConfig(refresh_interval_s=60, disagg=disagg, grpc_port=0, resilience={"retry_after_s": 2}), disc)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvyard", timeout=20) as client:
            yield Stack(app, client, disc)


def sse_events(text: str) -> list[str]:
    return [e for e in text.split("\n\n") if e]


def streamed_text(text: str, chat: bool) -> str:
    out = ""
    for e in sse_events(text):
        if e == "data: [DONE]":
            continue
        for c in json.loads(e[6:]).get("choices", []):
            out += (c.get("delta") or {}).get("content") or "" if chat else c.get("text") or ""
    return out


# ---- vLLM --------------------------------------------------------------------------------------------

async def test_vllm_stream_golden_bodies(stack):
    book = HandoffBook()
    with FakePDEngine("vllm", "prefill", book) as p, FakePDEngine("vllm", "decode", book, tokens=4) as d:
        await stack.add(winfo("p", p.url, "prefill", "vllm"), winfo("d", d.url, "decode", "vllm"))
        client_body = {"model": "m", "prompt": LONG, "max_tokens": 4, "stream": True, "min_tokens": 2, "temperature": 0.0}
        r = await stack.client.post("/v1/completions", json=client_body)
        assert r.status_code == 200, r.text
        assert streamed_text(r.text, chat=False) == "xxxx"
        assert sse_events(r.text)[-1] == "data: [DONE]"
        # the frontend asks a vLLM-protocol engine for token ids on streams (exact mid-stream migration); the client never sees them
        assert p.bodies == [{"model": "m", "prompt": LONG, "max_tokens": 1, "stream": False, "temperature": 0.0,
                             "return_token_ids": True, "kv_transfer_params": VLLM_PREFILL_PARAMS}]
        assert 'token_ids":[' not in r.text
        handoff = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3], "remote_engine_id": p.engine_id,
                   "remote_request_id": r.headers["x-request-id"], "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1,
                   "remote_blocks_expiry_time": d.bodies[0]["kv_transfer_params"]["remote_blocks_expiry_time"]}
        assert d.bodies == [{**client_body, "stream_options": {"include_usage": True}, "return_token_ids": True, "kv_transfer_params": handoff}]
        rid = r.headers["x-request-id"]
        assert p.requests[0]["headers"]["x-request-id"] == d.requests[0]["headers"]["x-request-id"] == rid
        assert r.headers["x-kvyard-worker"] == "d"
        assert book.freed == [(p.engine_id, rid, "read")]
        assert stack.decisions("remote", "long_prompt") == 1
        assert stack.books_closed()


async def test_vllm_chat_unary_golden_bodies(stack):
    book = HandoffBook()
    with FakePDEngine("vllm", "prefill", book) as p, FakePDEngine("vllm", "decode", book, tokens=3) as d:
        await stack.add(winfo("p", p.url, "prefill", "vllm"), winfo("d", d.url, "decode", "vllm"))
        client_body = {"model": "m", "messages": [{"role": "user", "content": LONG}], "max_completion_tokens": 3,
                       "min_completion_tokens": 1}
        r = await stack.client.post("/v1/chat/completions", json=client_body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "xxx"
        assert p.bodies == [{"model": "m", "messages": client_body["messages"], "max_tokens": 1, "max_completion_tokens": 1,
                             "stream": False, "kv_transfer_params": VLLM_PREFILL_PARAMS}]
        assert d.bodies[0] == {**client_body, "kv_transfer_params": d.bodies[0]["kv_transfer_params"]}
        assert d.bodies[0]["kv_transfer_params"]["remote_engine_id"] == p.engine_id
        assert stack.books_closed()


async def test_vllm_prefill_failure_falls_back_to_aggregated(stack):
    book = HandoffBook()
    with FakePDEngine("vllm", "prefill", book, fail_status=500) as p, FakePDEngine("vllm", "decode", book, tokens=3) as d:
        await stack.add(winfo("p", p.url, "prefill", "vllm"), winfo("d", d.url, "decode", "vllm"))
        body = {"model": "m", "prompt": LONG, "max_tokens": 3, "stream": True}
        r = await stack.client.post("/v1/completions", json=body)
        assert r.status_code == 200 and streamed_text(r.text, chat=False) == "xxx"
        assert len(p.bodies) == 1
        assert d.bodies == [{**body, "stream_options": {"include_usage": True}, "return_token_ids": True}]  # the plain request: no hand-off
        assert stack.decisions("fallback", "prefill_error") == 1
        assert stack.books_closed()


async def test_vllm_malformed_prefill_answer_falls_back(stack):
    book = HandoffBook()
    with FakePDEngine("vllm", "prefill", book, omit_handoff=True) as p, FakePDEngine("vllm", "decode", book) as d:
        await stack.add(winfo("p", p.url, "prefill", "vllm"), winfo("d", d.url, "decode", "vllm"))
        r = await stack.client.post("/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xx"
        assert "kv_transfer_params" not in d.bodies[0]
        assert stack.decisions("fallback", "prefill_bad_response") == 1


async def test_lost_prefill_worker_falls_back(stack):
    book = HandoffBook()
    with FakePDEngine("vllm", "decode", book) as d:
        await stack.add(winfo("p", f"http://127.0.0.1:{free_port()}", "prefill", "vllm"), winfo("d", d.url, "decode", "vllm"))
        r = await stack.client.post("/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xx"
        assert stack.decisions("fallback", "prefill_unreachable") == 1
        assert stack.books_closed()


@pytest.mark.parametrize("stack", [DisaggConfig(prefill_timeout_s=0.3)], indirect=True)
async def test_slow_prefill_times_out_and_is_aborted(stack):
    book = HandoffBook()
    with FakePDEngine("vllm", "prefill", book, delay_s=3.0) as p, FakePDEngine("vllm", "decode", book) as d:
        await stack.add(winfo("p", p.url, "prefill", "vllm"), winfo("d", d.url, "decode", "vllm"))
        r = await stack.client.post("/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xx"
        assert stack.decisions("fallback", "prefill_timeout") == 1
        for _ in range(200):  # the dropped connection reaches the prefill engine, which aborts the request
            if p.cancelled:
                break
            await asyncio.sleep(0.01)
        assert p.cancelled == 1 and not book.held
        assert stack.books_closed()


@pytest.mark.parametrize("stack", [DisaggConfig(enforce=True)], indirect=True)
async def test_enforce_disagg_is_a_clean_503(stack):
    book = HandoffBook()
    with FakePDEngine("vllm", "prefill", book, fail_status=500) as p, FakePDEngine("vllm", "decode", book) as d:
        await stack.add(winfo("p", p.url, "prefill", "vllm"), winfo("d", d.url, "decode", "vllm"))
        r = await stack.client.post("/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 503
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and "enforced" in err["message"]
        assert d.bodies == []  # never served aggregated
        assert stack.decisions("rejected", "prefill_error") == 1
        assert stack.books_closed()


@pytest.mark.parametrize("flavor", ["vllm", "sglang", "trtllm"])
async def test_failed_decode_gets_the_whole_handoff_again(stack, flavor):
    """A decode engine that fails the hand-off once (real vLLM: its NIXL handshake missed the 5 s timeout on a
    busy host, so the KV load failed) is not the client's 503: a fresh prefill, a fresh decode, once."""
    book = HandoffBook()
    with FakePDEngine(flavor, "prefill", book) as p, FakePDEngine(flavor, "decode", book, tokens=3, fail_status=500, fail_times=1) as d:
        await stack.add(winfo("p", p.url, "prefill", flavor, bootstrap_port=9123), winfo("d", d.url, "decode", flavor))
        r = await stack.client.post("/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 3, "stream": True})
        assert r.status_code == 200, r.text
        assert streamed_text(r.text, chat=False) == "xxx"
        assert len(p.bodies) == len(d.bodies) == 2  # the hand-off twice, both legs
        if flavor == "sglang":  # a new bootstrap room for the second try
            assert p.bodies[0]["bootstrap_room"] != p.bodies[1]["bootstrap_room"] == d.bodies[1]["bootstrap_room"]
        elif flavor == "trtllm":  # a new context, and the generation names it
            ids = [b["disaggregated_params"]["disagg_request_id"] for b in p.bodies]
            assert ids[0] != ids[1] == d.bodies[1]["disaggregated_params"]["disagg_request_id"]
        else:
            assert "kv_transfer_params" in d.bodies[1]
        assert stack.decisions("retry", "decode_error") == 1
        assert stack.decisions("fallback", "decode_error") == 0
        assert stack.books_closed()


async def test_decode_failing_every_handoff_falls_back_to_aggregated(stack):
    book = HandoffBook()
    with FakePDEngine("vllm", "prefill", book) as p, FakePDEngine("vllm", "decode", book, tokens=2, fail_status=500, fail_times=2) as d:
        await stack.add(winfo("p", p.url, "prefill", "vllm"), winfo("d", d.url, "decode", "vllm"))
        body = {"model": "m", "prompt": LONG, "max_tokens": 2}
        r = await stack.client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "xx"
        assert len(p.bodies) == 2 and len(d.bodies) == 3  # two hand-offs (one retry), then the whole request on decode
        assert [("kv_transfer_params" in b) for b in d.bodies] == [True, True, False]
        assert stack.decisions("retry", "decode_error") == 1
        assert stack.decisions("fallback", "decode_error") == 1
        assert stack.books_closed()


@pytest.mark.parametrize("stack", [DisaggConfig(enforce=True)], indirect=True)
async def test_enforce_disagg_decode_failure_is_a_clean_503(stack):
    book = HandoffBook()
    with FakePDEngine("vllm", "prefill", book) as p, FakePDEngine("vllm", "decode", book, fail_status=500) as d:
        await stack.add(winfo("p", p.url, "prefill", "vllm"), winfo("d", d.url, "decode", "vllm"))
        r = await stack.client.post("/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 503
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and "decode_error" in err["message"]
        assert len(p.bodies) == len(d.bodies) == 2  # the retry, and never served aggregated
        assert stack.decisions("rejected", "decode_error") == 1
        assert stack.books_closed()


@pytest.mark.parametrize("stack", [DisaggConfig(handoff_retries=0)], indirect=True)
async def test_handoff_retries_zero_falls_back_at_once(stack):
    book = HandoffBook()
    with FakePDEngine("vllm", "prefill", book) as p, FakePDEngine("vllm", "decode", book, tokens=2, fail_status=500, fail_times=1) as d:
        await stack.add(winfo("p", p.url, "prefill", "vllm"), winfo("d", d.url, "decode", "vllm"))
        r = await stack.client.post("/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert len(p.bodies) == 1 and [("kv_transfer_params" in b) for b in d.bodies] == [True, False]
        assert stack.decisions("retry", "decode_error") == 0 and stack.decisions("fallback", "decode_error") == 1
        assert stack.books_closed()


async def test_vllm_client_cancel_mid_stream_reaches_decode_which_frees_prefill_blocks(stack):
    book = HandoffBook()
    with FakePDEngine("vllm", "prefill", book) as p, FakePDEngine("vllm", "decode", book, tokens=200, token_delay_s=0.02) as d:
        await stack.add(winfo("p", p.url, "prefill", "vllm"), winfo("d", d.url, "decode", "vllm"))
        disp = await stack.service.dispatch(json.dumps({"model": "m", "prompt": LONG, "max_tokens": 200, "stream": True}).encode(),
                                            "completions")
        events = stack.service.stream_events(disp)
        first = await events.__anext__()
        assert b'"text":"x"' in first
        await events.aclose()  # what a client disconnect does to the relay
        for _ in range(200):
            if d.cancelled:
                break
            await asyncio.sleep(0.01)
        assert d.cancelled == 1 and p.completed == 1
        assert book.freed == [(p.engine_id, disp.rreq.request_id, "abort")]  # decode's abort notified prefill
        assert stack.books_closed()


# ---- conditional disaggregation ----------------------------------------------------------------------

async def test_prompt_cached_on_decode_is_prefilled_locally(stack):
    book = HandoffBook()
    with FakePDEngine("vllm", "prefill", book) as p, FakePDEngine("vllm", "decode", book) as d:
        await stack.add(winfo("p", p.url, "prefill", "vllm"), winfo("d", d.url, "decode", "vllm"))
        body = {"model": "m", "prompt": LONG, "max_tokens": 2}
        assert (await stack.client.post("/v1/completions", json=body)).status_code == 200
        # the decode worker now holds the prompt's blocks (predicted from routing): the rest is short and cached
        r = await stack.client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xx"
        assert len(p.bodies) == 1 and d.bodies[1] == body
        assert stack.decisions("remote", "long_prompt") == 1
        assert stack.decisions("local", "cached_on_decode") == 1
        assert stack.books_closed()


@pytest.mark.parametrize("stack", [DisaggConfig(queue_threshold=1.0, max_num_batched_tokens=50)], indirect=True)
async def test_saturated_prefill_pool_is_bypassed(stack):
    book = HandoffBook()
    with FakePDEngine("vllm", "prefill", book, delay_s=0.5) as p, FakePDEngine("vllm", "decode", book) as d:
        await stack.add(winfo("p", p.url, "prefill", "vllm"), winfo("d", d.url, "decode", "vllm"))
        first = asyncio.create_task(stack.client.post("/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2}))
        for _ in range(100):  # wait until the first prefill is in flight (> 50 active tokens on p)
            if p.requests:
                break
            await asyncio.sleep(0.01)
        other = "a completely different prompt about sailing boats and the wind " * 8
        r2 = await stack.client.post("/v1/completions", json={"model": "m", "prompt": other, "max_tokens": 2})
        assert r2.status_code == 200 and (await first).status_code == 200
        assert len(p.bodies) == 1
        assert stack.decisions("local", "prefill_saturated") == 1
        assert stack.books_closed()


async def test_aggregated_models_never_touch_prefill_workers(stack):
    """A model with only `both` workers is served as before; a prefill-only worker is never an aggregated target."""
    book = HandoffBook()
    with FakePDEngine("vllm", "both", book) as b:
        await stack.add(winfo("b", b.url, "both", "vllm"))
        r = await stack.client.post("/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 200 and "kv_transfer_params" not in b.bodies[0]
        assert not stack.service.disagg.applies("m")


# ---- SGLang --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chat, stream", [(False, True), (True, False)])
async def test_sglang_same_body_to_both_concurrently(stack, chat, stream):
    book = HandoffBook()
    with FakePDEngine("sglang", "prefill", book, delay_s=0.2) as p, FakePDEngine("sglang", "decode", book, tokens=3) as d:
        await stack.add(winfo("p", p.url, "prefill", "sglang", bootstrap_port=9123), winfo("d", d.url, "decode", "sglang"))
        if chat:
            body, path = {"model": "m", "messages": [{"role": "user", "content": LONG}], "max_tokens": 3, "stream": stream}, "/v1/chat/completions"
        else:
            body, path = {"model": "m", "prompt": LONG, "max_tokens": 3, "stream": stream}, "/v1/completions"
        r = await stack.client.post(path, json=body)
        assert r.status_code == 200, r.text
        text = streamed_text(r.text, chat) if stream else (r.json()["choices"][0]["message"]["content"] if chat else r.json()["choices"][0]["text"])
        assert text == "xxx"
        assert p.bodies == d.bodies  # one body, to both
        sent = p.bodies[0]
        room = sent["bootstrap_room"]
        assert isinstance(room, int) and 0 <= room <= 2**63 - 1
        expected = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": 9123, "bootstrap_room": room}
        if stream:
            expected["stream_options"] = {"include_usage": True}
        assert sent == expected
        # concurrently: decode was asked while prefill was still working (it waited for the room)
        assert d.requests and book.rooms == {room}
        assert stack.books_closed()


async def test_sglang_prefill_failure_cancels_decode_and_falls_back_to_a_whole_worker(stack):
    book = HandoffBook()
    with FakePDEngine("sglang", "prefill", book, fail_status=500, delay_s=0.3) as p, \
            FakePDEngine("sglang", "decode", book) as d, FakePDEngine("sglang", "both", book, tokens=2) as b:
        await stack.add(winfo("p", p.url, "prefill", "sglang"), winfo("d", d.url, "decode", "sglang"), winfo("b", b.url, "both", "sglang"))
        body = {"model": "m", "prompt": LONG, "max_tokens": 2, "stream": True}
        r = await stack.client.post("/v1/completions", json=body)
        assert r.status_code == 200 and streamed_text(r.text, chat=False) == "xx"
        assert r.headers["x-kvyard-worker"] == "b"
        assert b.bodies == [{**body, "stream_options": {"include_usage": True}}]
        for _ in range(200):
            if d.cancelled:
                break
            await asyncio.sleep(0.01)
        assert d.cancelled == 1  # the decode request waiting on the room was cancelled
        assert stack.decisions("fallback", "prefill_error") == 1
        assert stack.books_closed()


async def test_sglang_prefill_failure_without_a_whole_worker_is_503(stack):
    book = HandoffBook()
    with FakePDEngine("sglang", "prefill", book, fail_status=500) as p, FakePDEngine("sglang", "decode", book) as d:
        await stack.add(winfo("p", p.url, "prefill", "sglang"), winfo("d", d.url, "decode", "sglang"))
        r = await stack.client.post("/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 503 and "SGLang" in r.json()["error"]["message"]
        assert stack.books_closed()


async def test_sglang_cancel_while_both_in_flight_reaches_both(stack):
    book = HandoffBook()
    with FakePDEngine("sglang", "prefill", book, delay_s=3.0) as p, FakePDEngine("sglang", "decode", book) as d:
        await stack.add(winfo("p", p.url, "prefill", "sglang"), winfo("d", d.url, "decode", "sglang"))
        raw = json.dumps({"model": "m", "prompt": LONG, "max_tokens": 2, "stream": True}).encode()
        task = asyncio.create_task(stack.service.dispatch(raw, "completions"))
        for _ in range(200):
            if p.requests and d.requests:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(300):
            if p.cancelled and d.cancelled:
                break
            await asyncio.sleep(0.01)
        assert (p.cancelled, d.cancelled) == (1, 1)
        assert stack.books_closed()


# ---- TensorRT-LLM ----------------------------------------------------------------------------------------

async def test_trtllm_context_then_generation_golden(stack):
    book = HandoffBook()
    with FakePDEngine("trtllm", "prefill", book) as p, FakePDEngine("trtllm", "decode", book, tokens=3) as d:
        await stack.add(winfo("p", p.url, "prefill", "trtllm"), winfo("d", d.url, "decode", "trtllm"))
        body = {"model": "m", "prompt": LONG, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
        r = await stack.client.post("/v1/completions", json=body)
        assert r.status_code == 200 and streamed_text(r.text, chat=False) == "xxx"
        ctx = p.bodies[0]
        disagg_id = ctx["disaggregated_params"]["disagg_request_id"]
        assert isinstance(disagg_id, int) and disagg_id > 0
        assert ctx == {"model": "m", "prompt": LONG, "max_tokens": 3, "stream": False, "stream_options": None,
                       "disaggregated_params": {"request_type": "context_only", "disagg_request_id": disagg_id}}
        ctx_id = d.bodies[0]["disaggregated_params"]["ctx_request_id"]
        assert d.bodies == [{"model": "m", "prompt": [11, 12, 13], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
                             "disaggregated_params": {"request_type": "generation_only", "first_gen_tokens": [7], "ctx_request_id": ctx_id,
                                                      "encoded_opaque_state": "b3BhcXVl", "draft_tokens": None,
                                                      "disagg_request_id": disagg_id}}]
        assert [e for e in sse_events(r.text) if '"usage"' in e]  # the client asked for usage: passed on
        assert stack.books_closed()


async def test_trtllm_chat_generation_uses_prompt_token_ids(stack):
    book = HandoffBook()
    with FakePDEngine("trtllm", "prefill", book) as p, FakePDEngine("trtllm", "decode", book, tokens=2) as d:
        await stack.add(winfo("p", p.url, "prefill", "trtllm"), winfo("d", d.url, "decode", "trtllm"))
        body = {"model": "m", "messages": [{"role": "user", "content": LONG}], "max_tokens": 2}
        r = await stack.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "xx"
        gen = d.bodies[0]
        assert gen["messages"] == body["messages"] and gen["prompt_token_ids"] == [11, 12, 13] and "prompt" not in gen
        assert gen["disaggregated_params"]["request_type"] == "generation_only"


@pytest.mark.parametrize("stream", [False, True])
async def test_trtllm_finished_context_is_the_answer(stack, stream):
    book = HandoffBook()
    with FakePDEngine("trtllm", "prefill", book, ctx_finish_reason="stop") as p, FakePDEngine("trtllm", "decode", book) as d:
        await stack.add(winfo("p", p.url, "prefill", "trtllm"), winfo("d", d.url, "decode", "trtllm"))
        r = await stack.client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": LONG}],
                                                                  "max_tokens": 5, "stream": stream})
        assert r.status_code == 200, r.text
        assert d.bodies == []  # no generation request
        if stream:
            events = sse_events(r.text)
            assert events[-1] == "data: [DONE]"
            chunk = json.loads(events[0][6:])
            assert chunk["object"] == "chat.completion.chunk"
            assert chunk["choices"][0]["delta"]["content"] == "x" and chunk["choices"][0]["finish_reason"] == "stop"
            assert not [e for e in events if '"usage"' in e]  # the client did not ask for usage
        else:
            assert r.json()["choices"][0]["finish_reason"] == "stop"
        assert stack.books_closed()


async def test_trtllm_context_failure_falls_back(stack):
    book = HandoffBook()
    with FakePDEngine("trtllm", "prefill", book, fail_status=503) as p, FakePDEngine("trtllm", "decode", book, tokens=2) as d:
        await stack.add(winfo("p", p.url, "prefill", "trtllm"), winfo("d", d.url, "decode", "trtllm"))
        r = await stack.client.post("/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xx"
        assert "disaggregated_params" not in d.bodies[0]
        assert stack.decisions("fallback", "prefill_error") == 1


# ---- gRPC goes through the same dispatch -------------------------------------------------------------------

async def test_grpc_model_infer_is_disaggregated_too():
    import numpy as np
    import tritonclient.grpc.aio as tgrpc
    from tritonclient.grpc import InferInput

    disc, port = InMemoryDiscovery(), free_port()
    app = create_app(FrontendConfig(refresh_interval_s=60, grpc_port=port, resilience={"retry_after_s": 2}), disc)
    book = HandoffBook()
    async with app.router.lifespan_context(app):
        client = tgrpc.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            with FakePDEngine("vllm", "prefill", book) as p, FakePDEngine("vllm", "decode", book, tokens=5) as d:
                stack = Stack(app, None, disc)
                await stack.add(winfo("p", p.url, "prefill", "vllm"), winfo("d", d.url, "decode", "vllm"))
                text = InferInput("text_input", [1], "BYTES")
                text.set_data_from_numpy(np.array([LONG.encode()], dtype=object))
                sampling = InferInput("sampling_parameters", [1], "BYTES")
                sampling.set_data_from_numpy(np.array([b'{"max_tokens": 3}'], dtype=object))
                r = await client.infer("m", [text, sampling], request_id="g1")
                assert r.as_numpy("text_output").tolist() == [b"xxx"]
                assert p.bodies[0]["kv_transfer_params"] == VLLM_PREFILL_PARAMS and p.bodies[0]["max_tokens"] == 1
                assert d.bodies[0]["kv_transfer_params"]["remote_engine_id"] == p.engine_id and d.bodies[0]["max_tokens"] == 3
                assert stack.decisions("remote", "long_prompt") == 1 and stack.books_closed()
        finally:
            await client.close()


# ---- edges -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stack, status, mode", [(DisaggConfig(), 200, "fallback"), (DisaggConfig(enforce=True), 503, "rejected")],
                         indirect=["stack"])
async def test_decode_workers_without_prefill_workers(stack, status, mode):
    book = HandoffBook()
    with FakePDEngine("vllm", "decode", book) as d:
        await stack.add(winfo("d", d.url, "decode", "vllm"))
        r = await stack.client.post("/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == status, r.text
        assert len(d.bodies) == (1 if status == 200 else 0)
        assert stack.decisions(mode, "no_prefill_worker") == 1
        assert stack.books_closed()


async def test_prefill_engine_client_error_is_passed_on(stack):
    """A 4xx from the prefill engine is the client's own error (a bad parameter): returned as is, not retried."""
    book = HandoffBook()
    with FakePDEngine("vllm", "prefill", book, fail_status=400) as p, FakePDEngine("vllm", "decode", book) as d:
        await stack.add(winfo("p", p.url, "prefill", "vllm"), winfo("d", d.url, "decode", "vllm"))
        r = await stack.client.post("/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["message"] == "scripted failure"
        assert d.bodies == []
        assert stack.books_closed()


async def test_sglang_decode_never_prefills_locally(stack):
    """The conditional rule would prefill a prompt cached on decode locally; a decode-mode SGLang engine cannot."""
    book = HandoffBook()
    with FakePDEngine("sglang", "prefill", book) as p, FakePDEngine("sglang", "decode", book) as d:
        await stack.add(winfo("p", p.url, "prefill", "sglang"), winfo("d", d.url, "decode", "sglang"))
        body = {"model": "m", "prompt": LONG, "max_tokens": 2}
        for _ in range(2):
            assert (await stack.client.post("/v1/completions", json=body)).status_code == 200
        assert len(p.bodies) == 2 and all("bootstrap_room" in b for b in d.bodies)
        assert stack.decisions("remote", "decode_cannot_prefill") == 1


def test_prefill_router_reuse_credit():
    """The prefill pool routes on the aggregated router's overlap weight with the reuse credit measured there (16,
    benchmarks/results/routing_disagg.md), whatever the aggregated default; disagg.prefill_reuse_weight None takes
    the frontend's kv_reuse_weight."""
    cases = ((DisaggConfig(), 16.0), (DisaggConfig(prefill_reuse_weight=None), 3.0), (DisaggConfig(prefill_reuse_weight=1), 1.0),
             (DisaggConfig(prefill_reuse_weight=0), 0.0))
    for disagg, want in cases:
        app = create_app(FrontendConfig(disagg=disagg, grpc_port=0, router={"kv": {"overlap_weight": 8, "reuse_weight": 3}}), InMemoryDiscovery())
        scorer, _ = app.state.service.disagg.prefill_router.policy.scorers[0]
        assert (scorer.overlap_weight, scorer.reuse_weight) == (8.0, want)
    with pytest.raises(ValueError):
        DisaggConfig(prefill_reuse_weight=-1)
