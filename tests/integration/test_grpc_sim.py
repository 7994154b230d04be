"""gRPC vs HTTP on the sim engine: the same prompts give the same text and token counts either way.

One sim engine (EngineProcess + SimBackend, h200-llama3.1-8b, --speedup 10) behind an in-process
frontend with its gRPC endpoint on. Parity is checked four ways per prompt (HTTP unary, HTTP SSE,
gRPC ModelInfer, gRPC ModelStreamInfer deltas); the classic (threaded, callback) tritonclient API is
exercised too, and a cancelled gRPC stream must abort the request inside the engine.
"""

from __future__ import annotations

import asyncio
import json
import queue
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc_sync
import tritonclient.grpc.aio as tgrpc
from tritonclient.grpc import InferInput

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from orchestrator.testing import free_port
from workers.discovery import InMemoryDiscovery
from workers.process import EngineProcess
from workers.registry import get_backend
from workers.sim.backend import SIM_TOKENIZER_DIR
from workers.types import EngineLaunchConfig, WorkerInfo
from workers.vllm.metrics import parse_vllm_metrics

pytestmark = pytest.mark.slow

MODEL = "h200-llama3.1-8b"
MAX_MODEL_LEN = 4096
PROMPTS = ["Tell me about the sea.", "Write a haiku about gRPC streams", "héllo wörld — unicode ✓", "x"]


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    workdir = Path(tempfile.mkdtemp(prefix="kvy-grpc-"))
    cfg = EngineLaunchConfig(model=MODEL, served_model_name=MODEL, port=free_port(), block_size=16, max_model_len=MAX_MODEL_LEN,
                             kv_events_endpoint=f"ipc://{workdir}/ev.sock", kv_replay_endpoint=f"ipc://{workdir}/replay.sock",
                             extra_args=["--speedup", "10"])
    proc = EngineProcess(get_backend("sim"), cfg, log_path=workdir / "sim.log")
    try:
        proc.start()
        asyncio.run(proc.wait_healthy(timeout=60))
        yield proc.url
    finally:
        asyncio.run(proc.stop())
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
async def stack(sim_url):
    disc = InMemoryDiscovery()
    await disc.register(WorkerInfo(worker_id="sim-0", model=MODEL, backend="sim", url=sim_url, block_size=16,
                                   max_model_len=MAX_MODEL_LEN, tokenizer=str(SIM_TOKENIZER_DIR)), ttl_s=600)
    port = free_port()
    app = create_app(FrontendConfig(grpc_port=port), disc)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvyard", timeout=60) as http:
            client = tgrpc.InferenceServerClient(f"127.0.0.1:{port}")
            try:
                yield http, client, port, app
            finally:
                await client.close()


def grpc_inputs(prompt: str, stream: bool, max_tokens: int) -> list[InferInput]:
    text, flag, sampling = InferInput("text_input", [1], "BYTES"), InferInput("stream", [1], "BOOL"), InferInput("sampling_parameters", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    flag.set_data_from_numpy(np.array([stream]))
    sampling.set_data_from_numpy(np.array([json.dumps({"max_tokens": max_tokens, "temperature": 0}).encode()], dtype=object))
    return [text, flag, sampling]


def params(result) -> dict:
    return {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in result.get_response().parameters.items()}


async def http_answers(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[tuple, tuple]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    unary = (await http.post("/v1/completions", json=body)).json()
    r = await http.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    streamed = "".join(c["text"] for e in events for c in e["choices"])
    usage = events[-1]["usage"]
    u = unary["usage"]
    return ((unary["choices"][0]["text"], u["prompt_tokens"], u["completion_tokens"]),
            (streamed, usage["prompt_tokens"], usage["completion_tokens"]))


async def grpc_answers(client, prompt: str, max_tokens: int) -> tuple[tuple, tuple, int]:
    r = await client.infer(MODEL, grpc_inputs(prompt, False, max_tokens))
    p = params(r)
    unary = (r.as_numpy("text_output")[0].decode(), p["prompt_tokens"], p["completion_tokens"])

    async def one():
        yield {"model_name": MODEL, "inputs": grpc_inputs(prompt, True, max_tokens), "request_id": "p"}
    results = []
    async for res, err in client.stream_infer(one()):
        assert err is None, err
        results.append(res)
    finals = [params(x)["triton_final_response"] for x in results]
    assert finals[-1] is True and not any(finals[:-1])
    last = params(results[-1])
    streamed = b"".join(x.as_numpy("text_output")[0] for x in results).decode()
    return unary, (streamed, last["prompt_tokens"], last["completion_tokens"]), len(results)


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_grpc_and_http_give_the_same_answer(stack, prompt):
    http, client, _, _ = stack
    h_unary, h_stream = await http_answers(http, prompt, 12)
    g_unary, g_stream, n_responses = await grpc_answers(client, prompt, 12)
    assert h_unary[0] != "" and h_unary[2] == 12
    assert g_unary == h_unary
    assert g_stream == h_stream == h_unary
    assert n_responses >= 2  # deltas, then the final response


async def test_classic_threaded_client_streams_with_callbacks(stack):
    http, _, port, _ = stack
    (expected, _, n_tokens), _ = await http_answers(http, PROMPTS[0], 20)

    def run() -> list:
        got: queue.Queue = queue.Queue()
        with tgrpc_sync.InferenceServerClient(f"127.0.0.1:{port}") as c:
            assert c.is_server_ready() and c.is_model_ready(MODEL)
            c.start_stream(callback=lambda result, error: got.put((result, error)))
            c.async_stream_infer(MODEL, grpc_inputs(PROMPTS[0], True, 20), request_id="t1", enable_empty_final_response=True)
            out = []
            while True:
                result, error = got.get(timeout=30)
                assert error is None, error
                out.append(result)
                if params(result)["triton_final_response"]:
                    break
            c.stop_stream()
        return out

    results = await asyncio.to_thread(run)
    assert b"".join(r.as_numpy("text_output")[0] for r in results).decode() == expected
    assert params(results[-1])["completion_tokens"] == n_tokens == 20
    assert {r.get_response().id for r in results} == {"t1"}


async def test_cancelled_stream_aborts_in_the_engine(stack, sim_url):
    _, client, _, app = stack

    def abort_count() -> float:
        for line in httpx.get(sim_url + "/metrics").text.splitlines():
            if line.startswith('vllm:request_success_total{engine="0",finished_reason="abort"'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = abort_count()

    async def one():
        yield {"model_name": MODEL, "inputs": grpc_inputs("a long story " * 20, True, 3000), "request_id": "long"}
    it = client.stream_infer(one())
    for _ in range(5):
        res, err = await it.__anext__()
        assert err is None and not params(res)["triton_final_response"]
    it.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = parse_vllm_metrics(httpx.get(sim_url + "/metrics").text)
        if m.num_requests_running == 0 and abort_count() == before + 1:
            break
        await asyncio.sleep(0.05)
    assert abort_count() == before + 1
    assert app.state.router.loads.load("sim-0").inflight_requests == 0
