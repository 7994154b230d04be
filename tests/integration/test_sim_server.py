"""The sim engine as kvyard runs it: launched by EngineProcess + SimBackend, spoken to over HTTP and ZMQ.

Covers what the shared engine contract (test_engine_contract.py) does not: determinism, usage numbers,
request ids, stop strings, vLLM's 400/404 cases, /tokenize, prefix hits in /metrics, KV events and
replay with exact hashes, client-disconnect aborts (streaming and not) freeing blocks, preemption.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from router.kv_events import BlockStored
from workers.process import EngineProcess
from workers.sim.backend import SimBackend
from workers.sim.hashing import BlockHasher, to_external
from workers.types import EngineLaunchConfig
from workers.vllm.kv_events import END_SEQ, decode_pub_frames, decode_replay_frames, pack_seq
from workers.vllm.metrics import parse_vllm_metrics

pytestmark = pytest.mark.slow
MODEL = "sim-model"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sim:
    def __init__(self, extra: list[str], **cfg) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvy-simt-"))
        settings = dict(
            model="h200-llama3.1-8b", served_model_name=MODEL, port=_port(), block_size=16, max_model_len=1024,
            kv_events_endpoint=f"ipc://{self.dir}/ev.sock", kv_replay_endpoint=f"ipc://{self.dir}/replay.sock",
            kv_events_topic="kv", extra_args=extra,
        )  # fmt: skip
        self.cfg = EngineLaunchConfig(**{**settings, **cfg})
        self.proc = EngineProcess(SimBackend(), self.cfg, log_path=self.dir / "sim.log")
        self.url = self.proc.url

    def __enter__(self) -> Sim:
        self.proc.start()
        asyncio.run(self.proc.wait_healthy(timeout=60))
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run(self.proc.stop())
        shutil.rmtree(self.dir, ignore_errors=True)

    def post(self, path: str, body: dict, timeout: float = 60, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout, **kw)

    def metrics(self):
        return parse_vllm_metrics(httpx.get(self.url + "/metrics").text)

    def metric(self, line_prefix: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(line_prefix):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(line_prefix)


@pytest.fixture(scope="module")
def sim() -> Iterator[Sim]:
    with Sim(["--speedup", "20"]) as s:
        yield s


@pytest.fixture(scope="module")
def slow_sim() -> Iterator[Sim]:
    """Real-time (speedup 1) so that a long generation is still running when the client leaves."""
    with Sim([]) as s:
        yield s


def sse(text: str) -> list[dict]:
    assert text.endswith("data: [DONE]\n\n")
    return [json.loads(e[6:]) for e in text.split("\n\n")[:-2]]


def test_completion_and_stream_agree_and_are_deterministic(sim):
    body = {"model": MODEL, "prompt": "Tell me about the sea.", "max_tokens": 12}
    a, b = sim.post("/v1/completions", body).json(), sim.post("/v1/completions", body).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"] != ""
    assert a["id"].startswith("cmpl-") and a["object"] == "text_completion" and a["model"] == MODEL
    assert a["usage"] == {"prompt_tokens": 6, "total_tokens": 18, "completion_tokens": 12,
                          "prompt_tokens_details": None, "completion_tokens_details": None}  # fmt: skip
    chunks = sse(sim.post("/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}).text)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == a["choices"][0]["text"]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]  # tokens may coalesce under load, as in vLLM
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    other = sim.post("/v1/completions", {**body, "prompt": "Something else entirely."}).json()
    assert other["choices"][0]["text"] != a["choices"][0]["text"]


def test_chat_stream_and_default_max_tokens(sim):
    msgs = [{"role": "user", "content": "Hi there"}]
    r = sim.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_completion_tokens": 5, "stream": True})
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    chunks = sse(r.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and 2 <= len(chunks) <= 6
    full = sim.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 5}).json()
    assert full["id"].startswith("chatcmpl-") and full["choices"][0]["message"]["role"] == "assistant"
    assert full["choices"][0]["message"]["content"] == "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:])


def test_request_id_header_and_body(sim):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert sim.post("/v1/completions", body, headers={"X-Request-Id": "abc"}).json()["id"] == "cmpl-abc"
    assert sim.post("/v1/completions", {**body, "request_id": "zz"}).json()["id"] == "cmpl-zz"


def test_stop_string(sim):
    base = sim.post("/v1/completions", {"model": MODEL, "prompt": "stop test", "max_tokens": 10}).json()["choices"][0]["text"]
    word = base.split()[3]
    r = sim.post("/v1/completions", {"model": MODEL, "prompt": "stop test", "max_tokens": 10, "stop": [word]}).json()
    ch = r["choices"][0]
    assert (ch["finish_reason"], ch["stop_reason"]) == ("stop", word) and ch["text"] == base[: base.index(word)]


@pytest.mark.parametrize(
    "path,body,status,err_type,param",
    [
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "NotFoundError", "model"),
        ("/v1/completions", {"model": MODEL, "prompt": list(range(1025))}, 400, "BadRequestError", "input_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, "BadRequestError", "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "BadRequestError", "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "BadRequestError", None),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "a"}, 400, "Bad Request", "body.max_tokens"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "Bad Request", "body.messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2000},
         400, "BadRequestError", "max_completion_tokens"),
    ],
)  # fmt: skip
def test_errors_like_vllm(sim, path, body, status, err_type, param):
    r = sim.post(path, body)
    assert r.status_code == status
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == (err_type, param, status)


def test_info_routes_and_tokenize_roundtrip(sim):
    assert httpx.get(sim.url + "/version").json() == {"version": "0.32.0"}
    assert httpx.get(sim.url + "/load").json() == {"server_load": 0}
    models = httpx.get(sim.url + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 1024
    src = httpx.get(sim.url + "/kv_event_sources").json()["0"]
    assert src["endpoint"] == sim.cfg.kv_events_endpoint and src["topic"] == "kv" and src["enable_kv_cache_events"]
    tok = sim.post("/tokenize", {"model": MODEL, "prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) == 2 and tok["max_model_len"] == 1024
    assert sim.post("/detokenize", {"model": MODEL, "tokens": tok["tokens"]}).json() == {"prompt": "Hello world"}


def test_prefix_reuse_counts_hits(sim):
    prompt = "Shared system prompt. " * 20
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    sim.post("/v1/completions", body)
    before = sim.metrics()
    sim.post("/v1/completions", body)
    after = sim.metrics()
    n_prompt = sim.post("/tokenize", {"prompt": prompt}).json()["count"]
    assert after.prefix_cache_hits - before.prefix_cache_hits == (n_prompt - 1) // 16 * 16
    assert after.prefix_cache_queries - before.prefix_cache_queries == n_prompt


def test_kv_events_hashes_and_replay(sim):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(sim.cfg.kv_events_endpoint)
    time.sleep(0.3)
    prompt = "KV events are published per engine step. " * 8
    ids = sim.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    sim.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1})
    msgs = []
    while sub.poll(1000):
        msgs.append(sub.recv_multipart())
    stored = [e for m in msgs for e in decode_pub_frames(m).events if isinstance(e, BlockStored)]
    assert len(stored) == 1 and stored[0].parent_block_hash is None
    n_full = len(ids) // 16
    assert stored[0].block_hashes == [to_external(h) for h in BlockHasher(16).hash_all(ids)][:n_full]
    assert stored[0].token_ids == ids[: n_full * 16]
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(sim.cfg.kv_replay_endpoint)
    dealer.send_multipart([b"", pack_seq(0)])
    replies = []
    while dealer.poll(3000):
        replies.append(dealer.recv_multipart())
        if replies[-1][2] == pack_seq(END_SEQ, signed=True):
            break
    dealer.close(0)
    sub.close(0)
    ctx.term()
    assert replies[-1] == [b"", b"", pack_seq(END_SEQ, signed=True), b""]
    batches = [decode_replay_frames(r) for r in replies[:-1]]
    assert [b.seq for b in batches] == list(range(len(batches)))
    live = decode_pub_frames(msgs[-1])
    assert batches[live.seq].events == live.events


def _wait_idle(sim: Sim, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = sim.metrics()
        if m.num_requests_running == 0 and m.kv_cache_usage == 0.0:
            return
        time.sleep(0.1)
    raise AssertionError(f"sim not idle: {sim.metrics()}")


def test_stream_disconnect_aborts_and_frees_blocks(slow_sim):
    sim = slow_sim
    aborted = sim.metric('vllm:request_success_total{engine="0",finished_reason="abort"')
    body = {"model": MODEL, "prompt": "long generation " * 50, "max_tokens": 900, "stream": True}
    with httpx.stream("POST", sim.url + "/v1/completions", json=body, timeout=30) as r:
        it = r.iter_lines()
        for _ in range(3):
            next(it)
        m = sim.metrics()
        assert m.num_requests_running == 1 and m.kv_cache_usage > 0
    _wait_idle(sim)
    assert sim.metric('vllm:request_success_total{engine="0",finished_reason="abort"') == aborted + 1
    assert httpx.get(sim.url + "/load").json() == {"server_load": 0}


def test_non_stream_disconnect_aborts(slow_sim):
    sim = slow_sim
    body = {"model": MODEL, "prompt": "long generation, not streamed " * 50, "max_tokens": 700}
    errors: list[Exception] = []

    def client() -> None:
        try:
            sim.post("/v1/completions", body, timeout=0.5)
        except httpx.ReadTimeout as exc:  # the client gives up and closes the connection
            errors.append(exc)

    t = threading.Thread(target=client)
    t.start()
    time.sleep(0.3)
    assert sim.metrics().num_requests_running == 1
    t.join()
    assert errors
    _wait_idle(sim, timeout=3)


def test_preemption_under_block_pressure():
    # 24 usable blocks of 16 tokens; 4 requests that each grow to ~160 tokens (10 blocks) cannot all fit
    with Sim(["--speedup", "50", "--num-gpu-blocks", "25"], max_model_len=256) as s:
        body = {"model": MODEL, "prompt": "pressure " * 60, "max_tokens": 100}

        async def fire() -> list[dict]:
            async with httpx.AsyncClient(timeout=60) as c:
                rs = await asyncio.gather(*(c.post(s.url + "/v1/completions", json={**body, "prompt": f"{i} " + body["prompt"]}) for i in range(4)))
                return [r.json() for r in rs]

        out = asyncio.run(fire())
        assert all(o["usage"]["completion_tokens"] == 100 for o in out)
        assert s.metrics().num_preemptions > 0
