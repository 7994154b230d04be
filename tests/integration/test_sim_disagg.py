"""P/D disaggregation between two real sim processes, for each engine flavor's hand-off protocol.

A prefill sim and a decode sim run as `python -m workers.sim` processes; the test plays the proxy
(vLLM toy proxy / SGLang router / TRT-LLM disagg server) over HTTP and checks the hand-off fields,
streamed decode, stale/missing parameters, abort-notify and lease expiry freeing the prefill's
blocks (via its /metrics KV usage), and that the decode's TTFT includes the KV transfer time.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import zmq

from router.kv_events import BlockStored
from workers.sglang.kv_events import decode_pub_frames as decode_sglang_frames
from workers.trtllm.kv_events import decode_events as decode_trtllm_events
from workers.vllm.metrics import parse_vllm_metrics

pytestmark = pytest.mark.slow
MODEL = "sim-model"
NIXL = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
PROMPT = list(range(1000, 1600))  # 600 tokens


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def sim(*args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    port = _port()
    argv = [sys.executable, "-m", "workers.sim", "--port", str(port), "--served-model-name", MODEL, "--max-model-len", "2048",
            "--block-size", "16", *args]
    proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sim did not start: {proc.stderr.read().decode() if proc.stderr else ''}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the metrics")


def kv_usage(url: str, flavor: str = "vllm") -> float:
    """The KV-cache usage each engine reports: vLLM and SGLang on /metrics, TRT-LLM on /prometheus/metrics."""
    if flavor == "sglang":
        return _gauge(httpx.get(url + "/metrics").text, "sglang:token_usage")
    if flavor == "trtllm":
        return _gauge(httpx.get(url + "/prometheus/metrics").text, "trtllm_kv_cache_utilization")
    return parse_vllm_metrics(httpx.get(url + "/metrics").text).kv_cache_usage


def wait_until(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def stream_ttft(url: str, body: dict, path: str = "/v1/completions") -> tuple[float, str, list[dict]]:
    """(TTFT seconds, text, parsed events) of a streamed request."""
    t0 = time.monotonic()
    ttft, text, events = None, "", []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            events.append(ev)
            if ev.get("choices") and ev["choices"][0].get("text"):
                ttft = ttft if ttft is not None else time.monotonic() - t0
                text += ev["choices"][0]["text"]
    return (ttft if ttft is not None else float("nan")), text, events


# ---- vLLM (NixlConnector) -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_pd() -> Iterator[tuple[str, str, str]]:
    side = _port()
    # slow transfer (0.1 GB/s: 600 tokens x 128 KiB = 0.79 s) so the timing check is unambiguous; short lease
    common = ["--kv-transfer-bandwidth-gbps", "0.1"]
    p_cfg = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"kv_lease_duration": 2}})
    with sim("--kv-transfer-config", p_cfg, *common, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}) as p, \
         sim("--kv-transfer-config", NIXL, *common, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(_port())}) as d, \
         sim("--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                                  "kv_load_failure_policy": "recompute"}),
             env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(_port())}) as d_recompute:
        yield p, d, d_recompute


def _vllm_prefill(p: str, prompt: list[int] = PROMPT) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                   "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    r = httpx.post(p + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_vllm_handoff_streams_decode_and_frees_prefill(vllm_pd):
    p, d, _ = vllm_pd
    assert kv_usage(p) == 0.0
    res = _vllm_prefill(p)
    ktp = res["kv_transfer_params"]
    assert set(ktp) >= {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
                        "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
                        "remote_blocks_expiry_time", "transfer_mode"}
    assert ktp["do_remote_prefill"] is True and ktp["do_remote_decode"] is False
    assert ktp["remote_num_tokens"] == len(PROMPT) and ktp["transfer_mode"] == "pull"
    assert len(ktp["remote_block_ids"]) == 1 and len(ktp["remote_block_ids"][0]) == -(-len(PROMPT) // 16)
    assert kv_usage(p) > 0  # held for the decode

    ttft, text, _ = stream_ttft(d, {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "kv_transfer_params": ktp})
    assert text
    transfer = len(PROMPT) * 131072 / 0.1e9 + 0.001
    assert transfer <= ttft < transfer + 0.5, (ttft, transfer)  # the transfer is in the decode's TTFT
    assert wait_until(lambda: kv_usage(p) == 0.0, 5)  # read -> freed on the prefill side
    m = httpx.get(d + "/metrics").text
    lv = 'engine="0",model_name="sim-model"'
    assert f'vllm:prompt_tokens_by_source_total{{{lv},source="external_kv_transfer"}} 600.0' in m
    assert f'vllm:prompt_tokens_by_source_total{{{lv},source="local_compute"}} 0.0' in m  # no prefill compute on D

    # usage: the decode reports the prefill's cache hits as its cached tokens (vLLM 0.32), not the transfer
    ktp2 = _vllm_prefill(p, PROMPT[:320] + [9] * 64)["kv_transfer_params"]  # 320 tokens hit P's cache
    assert ktp2["remote_prefill_cached_tokens"] == 320
    r = httpx.post(d + "/v1/completions", json={"model": MODEL, "prompt": PROMPT[:320] + [9] * 64, "max_tokens": 2,
                                                 "kv_transfer_params": ktp2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 384

    # the same params again: already read -> load failure, "fail" policy -> 500 (streamed: error event)
    r = httpx.post(d + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": ktp})
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
    _, _, events = stream_ttft(d, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": ktp})
    assert events and events[-1]["error"]["code"] == 500


def test_vllm_missing_fields_and_recompute_policy(vllm_pd):
    p, d, d_recompute = vllm_pd
    bad = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_host": "localhost"}  # no request id/port/tp/blocks
    r = httpx.post(d + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": bad})
    assert r.status_code == 500
    r = httpx.post(d_recompute + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": bad})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    # stale (unknown request id) under "recompute": prefilled locally
    ktp = _vllm_prefill(p, [7] * 64)["kv_transfer_params"]
    stale = {**ktp, "remote_request_id": "no-such-request"}
    r = httpx.post(d_recompute + "/v1/completions", json={"model": MODEL, "prompt": [7] * 64, "max_tokens": 2, "kv_transfer_params": stale})
    assert r.status_code == 200
    assert wait_until(lambda: kv_usage(p) == 0.0, 6)  # the unread one expires (lease 2 s)


def test_vllm_abort_notify_and_rejection_free_prefill(vllm_pd):
    p, d, _ = vllm_pd
    # a decode rejected before the engine (max_tokens > max_model_len) still frees the prefill's blocks
    ktp = _vllm_prefill(p, [3] * 160)["kv_transfer_params"]
    assert kv_usage(p) > 0
    r = httpx.post(d + "/v1/completions", json={"model": MODEL, "prompt": [3] * 160, "max_tokens": 99999, "kv_transfer_params": ktp})
    assert r.status_code == 400
    assert wait_until(lambda: kv_usage(p) == 0.0, 1.5)  # well before the 2 s lease

    # a decode cancelled while its KV is in flight (0.79 s transfer) notifies the prefill too
    fresh = [t + 5000 for t in PROMPT]  # not in the decode's prefix cache: all 600 tokens to pull
    ktp = _vllm_prefill(p, fresh)["kv_transfer_params"]

    async def cancel_early() -> None:
        async with httpx.AsyncClient(timeout=10) as c:
            body = {"model": MODEL, "prompt": fresh, "max_tokens": 4, "kv_transfer_params": ktp}
            task = asyncio.ensure_future(c.post(d + "/v1/completions", json=body))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(cancel_early())
    assert wait_until(lambda: kv_usage(p) == 0.0, 1.5)
    assert wait_until(lambda: kv_usage(d) == 0.0, 1.5)


def test_vllm_lease_expiry_frees_unread_blocks(vllm_pd):
    p, _, _ = vllm_pd
    _vllm_prefill(p, [11] * 100)
    assert kv_usage(p) > 0
    time.sleep(1.0)
    assert kv_usage(p) > 0  # still leased
    assert wait_until(lambda: kv_usage(p) == 0.0, 4)


# ---- SGLang (bootstrap) ---------------------------------------------------------------------------

def test_sglang_bootstrap_handoff():
    boot = _port()
    events = json.dumps({"publisher": "zmq", "endpoint": "tcp://*:0", "topic": "kv"})  # SGLang: no enable flag
    with sim("--flavor", "sglang", "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot),
             "--kv-transfer-timeout", "3") as p, \
         sim("--flavor", "sglang", "--disaggregation-mode", "decode", "--kv-transfer-timeout", "1.5",
             "--kv-events-config", events) as d:
        endpoint = httpx.get(d + "/kv_event_sources").json()["0"]["endpoint"]
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(endpoint)
        time.sleep(0.3)  # let the subscription reach the publisher
        room = random.randint(0, 2**63 - 1)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "bootstrap_host": "127.0.0.1", "bootstrap_port": boot,
                "bootstrap_room": room}

        async def both() -> tuple[tuple[float, str, list], httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as c:
                pre = asyncio.ensure_future(c.post(p + "/v1/completions", json=body))
                dec = asyncio.get_running_loop().run_in_executor(None, stream_ttft, d, body)
                return await dec, await pre

        assert kv_usage(p, "sglang") == 0.0
        (ttft, text, _), pre = asyncio.run(both())
        assert pre.status_code == 200 and pre.json()["usage"]["completion_tokens"] == 1  # prefill: one token
        assert text
        assert wait_until(lambda: kv_usage(p, "sglang") == 0.0, 3)
        # the decode cached the transferred prompt: SGLang-format events, one per page (600 tokens = 37 pages)
        stored = []
        while sub.poll(1000):
            batch = decode_sglang_frames(sub.recv_multipart())
            stored += [e for e in batch.events if isinstance(e, BlockStored)]
            if sum(len(e.block_hashes) for e in stored) >= 37:
                break
        sub.close()
        ctx.term()
        assert stored and all(len(e.block_hashes) == 1 for e in stored)
        assert stored[0].token_ids == PROMPT[:16] and stored[1].parent_block_hash == stored[0].block_hashes[0]
        m = httpx.get(d + "/metrics").text
        assert _gauge(m, "sglang:generation_tokens_total") >= 6 and 'engine_type="decode"' in m
        # decode-mode without bootstrap fields: 400 in SGLang's flat error shape
        r = httpx.post(d + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["object"] == "error"
        # the prefill never comes: the decode fails after its timeout, and frees its preallocated blocks
        t0 = time.monotonic()
        r = httpx.post(d + "/v1/completions", json={**body, "bootstrap_room": room + 1}, timeout=30)
        assert r.status_code == 500 and time.monotonic() - t0 >= 1.5
        assert kv_usage(d, "sglang") == 0.0
        # the prefill's request for a room nobody pulls: held until its timeout (3 s), then freed
        pre = httpx.post(p + "/v1/completions", json={**body, "bootstrap_room": room + 2}, timeout=30)
        assert pre.status_code == 200 and kv_usage(p, "sglang") > 0
        assert wait_until(lambda: kv_usage(p, "sglang") == 0.0, 5)


# ---- TensorRT-LLM (disaggregated_params) ----------------------------------------------------------

def test_trtllm_context_generation_handoff():
    with sim("--flavor", "trtllm", "--kv-transfer-timeout", "2") as p, sim("--flavor", "trtllm") as d:
        ctx = httpx.post(p + "/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": False,
            "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 42}}, timeout=30)
        assert ctx.status_code == 200, ctx.text
        res = ctx.json()
        dp = res["choices"][0]["disaggregated_params"]
        assert res["choices"][0]["finish_reason"] == "length" and res["prompt_token_ids"] == PROMPT
        assert dp["request_type"] == "context_only" and isinstance(dp["ctx_request_id"], int)
        assert len(dp["first_gen_tokens"]) == 1 and dp["encoded_opaque_state"] and dp["disagg_request_id"] == 42
        assert kv_usage(p, "trtllm") > 0
        gen = {"model": MODEL, "prompt": res["prompt_token_ids"], "max_tokens": 8,
               "disaggregated_params": {**dp, "request_type": "generation_only"}}
        _, text, events = stream_ttft(d, gen)
        assert text and events[-1]["choices"][0]["finish_reason"] == "length"
        assert wait_until(lambda: kv_usage(p, "trtllm") == 0.0, 3)
        # decode side: the transferred blocks arrive as stored events on TRT-LLM's POST /kv_cache_events
        batches = decode_trtllm_events(httpx.post(d + "/kv_cache_events").content)
        stored = [e for b in batches if not isinstance(b, Exception) for e in b.events if isinstance(e, BlockStored)]
        assert sum(len(e.block_hashes) for e in stored) == len(PROMPT) // 16 and stored[0].token_ids[:16] == PROMPT[:16]
        assert httpx.post(d + "/kv_cache_events").json() == []  # drained
        stats = httpx.get(d + "/metrics").json()  # JSON iteration stats, drained
        assert stats and {"iter", "numActiveRequests", "kvCacheStats"} <= set(stats[0])
        # stale state (already read) -> error; missing state -> 400; both in TRT-LLM's flat error shape
        r = httpx.post(d + "/v1/completions", json=gen)
        assert r.status_code == 500 and r.json()["object"] == "error"
        missing = {**gen, "disaggregated_params": {"request_type": "generation_only", "ctx_request_id": dp["ctx_request_id"]}}
        r = httpx.post(d + "/v1/completions", json=missing)
        assert r.status_code == 400 and "encoded_opaque_state" in r.json()["message"]
        # unread context KV expires (--kv-transfer-timeout 2)
        httpx.post(p + "/v1/completions", json={"model": MODEL, "prompt": [5] * 40, "max_tokens": 4,
                                                 "disaggregated_params": {"request_type": "context_only"}})
        assert kv_usage(p, "trtllm") > 0
        assert wait_until(lambda: kv_usage(p, "trtllm") == 0.0, 5)
