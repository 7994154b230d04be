"""Disaggregated prefill/decode end to end: `kvyard up --prefill-workers 1 --decode-workers 1 --flavor X`
with real sim processes speaking each engine's hand-off protocol (workers/sim/disagg.py).

For each flavor: streamed and unary answers complete through the frontend's coordinator, the decision
is counted, the decode worker serves the answer; vLLM: a client that leaves mid-stream aborts the
decode request and the prefill worker's held blocks are freed (abort-notify); a prefill worker that
is gone falls back to aggregated serving (vLLM, TRT-LLM) or a clean 503 (SGLang without a `both`
worker, and under --enforce-disagg).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from orchestrator.testing import free_port
from tests.integration.up_admin import ADMIN_HEADERS, admin_env
from workers.vllm.metrics import parse_vllm_metrics

pytestmark = pytest.mark.slow

LONG = "the quick brown fox jumps over the lazy dog while the cat sleeps " * 40  # ~500 tokens: prefilled remotely


class Cluster:
    def __init__(self, client: httpx.AsyncClient, url: str, prefill: str, decode: str, proc: subprocess.Popen) -> None:
        self.client, self.url, self.prefill, self.decode, self.proc = client, url, prefill, decode, proc

    async def decisions(self) -> dict[tuple[str, str], float]:
        out = {}
        for line in (await self.client.get(self.url + "/metrics")).text.splitlines():
            if line.startswith("kvyard_disagg_decisions_total{"):
                labels, value = line[len("kvyard_disagg_decisions_total{"):].split("} ")
                kv = dict(p.split("=", 1) for p in labels.split(","))
                out[(kv["mode"].strip('"'), kv["reason"].strip('"'))] = float(value)
        return out

    async def engine(self, url: str):
        return parse_vllm_metrics((await self.client.get(url + "/metrics")).text)


async def start(tmp_path, flavor: str, *extra: str) -> Cluster:
    port, base = free_port(), _free_pair()
    log = open(tmp_path / "up.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "up", "--prefill-workers", "1", "--decode-workers", "1", "--flavor", flavor,
                             "--port", str(port), "--grpc-port", "0", "--base-port", str(base), "--speedup", "4", *extra],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=admin_env())
    url = f"http://127.0.0.1:{port}"
    client = httpx.AsyncClient(timeout=60, headers=ADMIN_HEADERS)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            body = (await client.get(url + "/api/cluster")).json()
            if sorted(w["role"] for w in body["workers"]) == ["decode", "prefill"]:
                by_role = {w["role"]: w["url"] for w in body["workers"]}  # as registered (launcher.py engine_port)
                return Cluster(client, url, by_role["prefill"], by_role["decode"], proc)
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        if proc.poll() is not None:
            break
        await asyncio.sleep(0.3)
    proc.kill()
    await client.aclose()
    pytest.fail("kvyard up did not start:\n" + (tmp_path / "up.log").read_text()[-3000:])


def _free_pair() -> int:
    """A port p with p and p + 1 both free now (the prefill and decode engines' HTTP ports)."""
    for _ in range(200):
        base = random.randint(20000, 60000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


async def stop(c: Cluster) -> None:
    await c.client.aclose()
    c.proc.send_signal(signal.SIGINT)
    try:
        c.proc.wait(60)
    except subprocess.TimeoutExpired:
        c.proc.kill()


def streamed(text: str, chat: bool) -> tuple[str, str | None]:
    out, finish = "", None
    for ev in (e for e in text.split("\n\n") if e.startswith("data: {")):
        for ch in json.loads(ev[6:]).get("choices", []):
            out += ((ch.get("delta") or {}).get("content") or "") if chat else (ch.get("text") or "")
            finish = ch.get("finish_reason") or finish
    return out, finish


@pytest.mark.parametrize("flavor", ["vllm", "sglang", "trtllm"])
async def test_disaggregated_answers_through_the_frontend(tmp_path, flavor):
    c = await start(tmp_path, flavor)
    try:
        r = await c.client.post(c.url + "/v1/completions", json={"model": "kvyard-sim", "prompt": LONG, "max_tokens": 12, "stream": True,
                                                                 "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        text, finish = streamed(r.text, chat=False)
        assert text and finish == "length"
        assert r.text.rstrip().endswith("data: [DONE]")
        usage = [json.loads(e[6:])["usage"] for e in r.text.split("\n\n") if e.startswith("data: {") and '"usage"' in e and '"choices":[]' in e]
        assert usage and usage[-1]["completion_tokens"] == 12
        assert r.headers["x-kvyard-worker"].startswith("sim-decode")

        r = await c.client.post(c.url + "/v1/chat/completions", json={"model": "kvyard-sim", "max_tokens": 8,
                                                                      "messages": [{"role": "user", "content": LONG + " chat"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["choices"][0]["message"]["content"]
        assert r.headers["x-kvyard-worker"].startswith("sim-decode")
        assert (await c.decisions()).get(("remote", "long_prompt")) == 2
    finally:
        await stop(c)


async def test_vllm_client_leaving_mid_stream_frees_both_sides(tmp_path):
    c = await start(tmp_path, "vllm")
    try:
        async with c.client.stream("POST", c.url + "/v1/completions", json={"model": "kvyard-sim", "prompt": LONG, "max_tokens": 2000,
                                                                            "stream": True}) as r:
            assert r.status_code == 200
            seen = 0
            async for chunk in r.aiter_raw():
                seen += chunk.count(b"data: {")
                if seen >= 3:
                    break  # leave: the connection is closed
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            dec, pre = await c.engine(c.decode), await c.engine(c.prefill)
            if dec.num_requests_running == 0 and pre.kv_cache_usage == 0:
                break
            await asyncio.sleep(0.2)
        assert dec.num_requests_running == 0  # the decode engine aborted the request
        assert pre.kv_cache_usage == 0  # and the prefill engine no longer holds its blocks
    finally:
        await stop(c)


@pytest.mark.parametrize("flavor, enforce, status, reason", [
    ("vllm", False, 200, ("fallback", "prefill_unreachable")),
    ("trtllm", False, 200, ("fallback", "prefill_unreachable")),
    ("sglang", False, 503, ("fallback", "prefill_unreachable")),  # a decode-mode SGLang engine cannot prefill alone
    ("vllm", True, 503, ("rejected", "prefill_unreachable")),
])
async def test_lost_prefill_worker(tmp_path, flavor, enforce, status, reason):
    c = await start(tmp_path, flavor, *(["--enforce-disagg"] if enforce else []))
    try:
        # the prefill engine dies; its lease has not lapsed yet, so the frontend still routes to it
        assert _kill_engine_on_port(int(c.prefill.rsplit(":", 1)[1]))
        r = await c.client.post(c.url + "/v1/completions", json={"model": "kvyard-sim", "prompt": LONG, "max_tokens": 5})
        assert r.status_code == status, r.text
        if status == 200:
            assert r.json()["usage"]["completion_tokens"] == 5
        else:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert (await c.decisions()).get(reason) == 1
    finally:
        await stop(c)


def _kill_engine_on_port(port: int) -> bool:
    """SIGKILL the sim process serving `port` (found by its command line, which names the port)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "workers.sim" in argv and any(a == "--port" and b == str(port) for a, b in zip(argv, argv[1:])):
            os.kill(int(entry), signal.SIGKILL)
            return True
    return False


async def test_prompt_cached_on_decode_is_prefilled_there(tmp_path):
    """Conditional disaggregation on real KV events: once the decode worker holds a prompt's blocks (it
    stored them when the hand-off arrived), the same prompt again is prefilled locally on decode."""
    c = await start(tmp_path, "vllm")
    try:
        body = {"model": "kvyard-sim", "prompt": LONG, "max_tokens": 4}
        assert (await c.client.post(c.url + "/v1/completions", json=body)).status_code == 200
        for _ in range(50):  # the decode worker's BlockStored events reach the index
            await asyncio.sleep(0.1)
            r = await c.client.post(c.url + "/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            if (await c.decisions()).get(("local", "cached_on_decode")):
                break
        assert (await c.decisions()).get(("local", "cached_on_decode")) == 1
        assert r.headers["x-kvyard-worker"].startswith("sim-decode")
    finally:
        await stop(c)
