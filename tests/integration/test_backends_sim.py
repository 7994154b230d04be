"""`kvyard worker --backend sglang|trtllm` end to end, with the sim standing in for the engine.

`--engine-cmd "python -m workers.sim --flavor X"` replaces `python -m sglang.launch_server` / `trtllm-serve`
and nothing else: the command line SglangBackend / TrtllmBackend build (the sim accepts both engines'
spellings), the launch, the health wait, the metrics scrape (`sglang:*` on /metrics, `trtllm_*` on
/prometheus/metrics), the KV events (SGLang's ZMQ format; TRT-LLM's drain-on-read POST /kv_cache_events
through the worker's relay), the P/D hand-off and the failure reports are the real worker code.

  - aggregated serving and KV routing: two workers, two frontends over one Redis; traffic through A only;
    B learns the caches from the events alone (for TRT-LLM that needs the relay: the engine hands each
    event out once) and routes every follow-up to the worker A placed its prefix on;
  - P/D: a prefill and a decode worker, every request prefilled remotely (--disagg-mode always);
  - bad input: an engine that exits while starting, one that never becomes healthy, and a TRT-LLM engine
    whose events do not decode each make the worker log the error, report it (GET /api/cluster
    `failed_workers`), deregister and exit non-zero, within seconds.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from orchestrator.testing.procs import KvyardCluster, free_port, full_blocks
from workers.sim.backend import SIM_TOKENIZER_DIR

pytestmark = [pytest.mark.slow, pytest.mark.redis]

REPO = Path(__file__).resolve().parents[2]
MODEL = "simmodel"
TOKENIZER = str(SIM_TOKENIZER_DIR)
BACKENDS = ["sglang", "trtllm"]
EVENT_FORMAT = {"sglang": "sglang", "trtllm": "vllm"}  # trtllm: what the worker's relay republishes


def sim_cmd(flavor: str, speedup: float = 20) -> str:
    return shlex.join([sys.executable, "-m", "workers.sim", "--flavor", flavor, "--speedup", str(speedup)])


def worker_args(backend: str, role: str = "both", cmd: str | None = None, *more: str) -> list[str]:
    return ["--engine-cmd", cmd or sim_cmd(backend), "--tokenizer", TOKENIZER, "--role", role, *more]


@pytest.fixture
async def cluster(redis_url, tmp_path):
    c = KvyardCluster(redis_url, tmp_path, MODEL, prefix=f"kvyard-be-{uuid.uuid4().hex[:8]}", max_model_len=4096)
    yield c
    c.stop()


def prompt(i: int, q: int) -> str:
    return f"Manual {i}: " + " ".join(f"step {i}.{j} turns valve {j % 7}." for j in range(120)) + f" Question {q}?"


async def indexed(http: httpx.AsyncClient, url: str) -> dict[str, int]:
    return (await http.get(url + "/api/cluster")).json()["kv"]["indexed_blocks"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_aggregated_serving_and_kv_routing_across_frontends(cluster: KvyardCluster, backend: str) -> None:
    for i in range(2):
        cluster.add_worker(f"w{i}", backend=backend, worker_args=worker_args(backend))
    cluster.add_frontend("fa")
    cluster.add_frontend("fb")
    await cluster.wait_ready("fa", 2, timeout=180)
    view = await cluster.wait_ready("fb", 2, timeout=180)
    assert {w["backend"] for w in view["workers"]} == {backend}
    async with httpx.AsyncClient(timeout=60) as http:
        a, b = cluster.url("fa"), cluster.url("fb")

        async def first(i: int) -> str:
            r = await http.post(a + "/v1/completions", json={"model": MODEL, "prompt": prompt(i, 0), "max_tokens": 3})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"]
            return r.headers["x-kvyard-worker"]

        # first sight of each prefix, concurrently so A's load term usually spreads them over both workers
        placed = dict(enumerate(await asyncio.gather(*(first(i) for i in range(4)))))
        # streamed chat through the same path
        async with http.stream("POST", a + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": prompt(0, 9)}], "max_tokens": 4, "stream": True}) as r:
            assert r.status_code == 200
            body = (await r.aread()).decode()
        assert body.rstrip().endswith("data: [DONE]") and '"delta"' in body
        # B saw none of those prompts: its index comes from the events (TRT-LLM: relayed by each worker). Wait until
        # B indexes at least every full prompt block on the worker A placed it on: equal counts alone can be met by
        # the first of several event batches (a relay poll or a ZMQ batch late on a busy host), and then B would route
        # a follow-up with no overlap, at random.
        need = full_blocks((worker, prompt(i, 0)) for i, worker in placed.items())
        deadline = time.monotonic() + 30
        while True:
            ia, ib = await indexed(http, a), await indexed(http, b)
            if ia == ib and all(ib.get(w, 0) >= n for w, n in need.items()):
                break
            assert time.monotonic() < deadline, f"B indexes {ib} (A {ia}), needs {need}\n{cluster.logs()}"
            await asyncio.sleep(0.1)
        followed = {}
        for i, worker in placed.items():
            r = await http.post(b + "/v1/completions", json={"model": MODEL, "prompt": prompt(i, 1), "max_tokens": 2})
            assert r.status_code == 200, r.text
            followed[i] = r.headers["x-kvyard-worker"]
        # B never saw these prompts and routes one at a time (no load of its own): only the events can send each to
        # the worker A placed its prefix on, and with every block indexed they do.
        assert followed == placed, f"B followed the cache for {sum(followed[i] == placed[i] for i in placed)} of 4 prefixes"
        view = (await http.get(b + "/api/cluster")).json()
        events = view["kv"]["events"]
        assert {e["format"] for e in events.values()} == {EVENT_FORMAT[backend]}
        # a worker that served nothing has published nothing (all four can land on one worker)
        assert all(events[w]["batches"] > 0 for w in placed.values()), events
        assert all(e["last_error"] is None for e in events.values()), events
        assert all(w["kv_usage"] is not None and w["running"] is not None for w in view["workers"])  # metrics scraped
        assert view["failed_workers"] == []


@pytest.mark.parametrize("backend", BACKENDS)
async def test_pd_with_a_prefill_and_a_decode_worker(cluster: KvyardCluster, backend: str) -> None:
    prefill_extra = ["--disaggregation-bootstrap-port", str(free_port())] if backend == "sglang" else []
    cluster.add_worker("p", backend=backend, worker_args=worker_args(backend, "prefill"), engine_args=prefill_extra)
    cluster.add_worker("d", backend=backend, worker_args=worker_args(backend, "decode"))
    cluster.add_frontend("f", extra=["--disagg-mode", "always"])
    view = await cluster.wait_ready("f", 2, timeout=180)
    roles = {w["role"]: w["worker_id"] for w in view["workers"]}
    assert set(roles) == {"prefill", "decode"}
    async with httpx.AsyncClient(timeout=60) as http:
        url = cluster.url("f")
        for stream in (False, True):
            body = {"model": MODEL, "prompt": prompt(7, int(stream)), "max_tokens": 5, "stream": stream}
            r = await http.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvyard-worker"] == roles["decode"]
            assert ("data: [DONE]" in r.text) if stream else r.json()["choices"][0]["text"]
        metrics = (await http.get(url + "/metrics")).text
    remote = [line for line in metrics.splitlines() if line.startswith("kvyard_disagg_decisions_total{") and 'mode="remote"' in line]
    assert remote and sum(float(line.rsplit(" ", 1)[1]) for line in remote) >= 2, metrics


def flat(log: str) -> str:
    """A worker log with rich's line wrapping undone (words of one message may sit on two lines)."""
    return " ".join(log.split())


async def _failed(cluster: KvyardCluster, frontend: str, backend: str, timeout: float = 60) -> dict:
    async with httpx.AsyncClient(timeout=5) as http:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            view = await cluster.cluster_view(frontend, http)
            if view is not None:
                got = [f for f in view["failed_workers"] if f["backend"] == backend]
                if got:
                    return {"failure": got[0], "view": view}
            await asyncio.sleep(0.2)
    raise AssertionError(f"no failure of a {backend} worker on /api/cluster\n{cluster.logs()}")


async def _exited(cluster: KvyardCluster, name: str, timeout: float = 60) -> int:
    proc = cluster.workers[name].proc
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        assert time.monotonic() < deadline, f"worker {name} still running\n{cluster.logs()}"
        await asyncio.sleep(0.1)
    return proc.returncode


@pytest.mark.parametrize("backend", BACKENDS)
async def test_engine_that_exits_while_starting(cluster: KvyardCluster, backend: str) -> None:
    crash = shlex.join([sys.executable, "-c", "import sys; print('fatal: no CUDA device'); sys.exit(3)"])
    cluster.add_frontend("f")
    cluster.add_worker("w", backend=backend, worker_args=worker_args(backend, cmd=crash))
    assert await _exited(cluster, "w") != 0
    got = await _failed(cluster, "f", backend)
    assert got["failure"]["phase"] == "start" and "exited with code 3" in got["failure"]["error"]
    assert "fatal: no CUDA device" in got["failure"]["error"]  # the engine's own words, from its log tail
    log = flat(cluster.workers["w"].log_tail())
    assert "engine failed to start" in log and "exited with code 3" in log
    assert got["view"]["workers"] == []


async def test_engine_that_never_becomes_healthy(cluster: KvyardCluster) -> None:
    hang = shlex.join([sys.executable, "-c", "import time; time.sleep(300)"])
    cluster.add_frontend("f")
    t0 = time.monotonic()
    cluster.add_worker("w", backend="sglang", worker_args=worker_args("sglang", "both", hang, "--engine-start-timeout", "3"))
    assert await _exited(cluster, "w") != 0
    assert time.monotonic() - t0 < 40
    got = await _failed(cluster, "f", "sglang")
    assert got["failure"]["phase"] == "start" and "not healthy after 3s" in got["failure"]["error"]
    assert "not healthy after 3s" in flat(cluster.workers["w"].log_tail())


async def test_trtllm_engine_whose_events_do_not_decode(cluster: KvyardCluster) -> None:
    bad = shlex.join([sys.executable, str(REPO / "tests" / "fixtures" / "engines" / "bad_trtllm.py")])
    cluster.add_frontend("f")
    cluster.add_worker("w", backend="trtllm", worker_args=worker_args("trtllm", cmd=bad))
    await cluster.wait_ready("f", 1, timeout=120, respawn=False)  # it is healthy and registers first
    assert await _exited(cluster, "w") != 0  # then its relay gives up (50 polls, 0.1 s apart)
    got = await _failed(cluster, "f", "trtllm")
    assert got["failure"]["phase"] == "serving" and "KV events unreadable" in got["failure"]["error"]
    assert "event_id must be a non-negative int" in got["failure"]["error"]
    log = flat(cluster.workers["w"].log_tail())
    assert "KV-event relay stopped" in log and "is this a TensorRT-LLM engine?" in log
    async with httpx.AsyncClient(timeout=5) as http:  # deregistered: the frontend drops it
        deadline = time.monotonic() + 20
        while (await cluster.cluster_view("f", http))["workers"]:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
