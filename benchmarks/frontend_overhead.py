"""Frontend overhead: the same streaming load straight at one sim engine and through kvyard's frontend.

For each concurrency (default 1, 16, 128) it runs the load direct, then through the frontend, in
the same run, and records TTFT/ITL p50/p99 and throughput for both, the added latency and the
throughput ratio. It also reads the frontend process's CPU time during its runs and reports
output tokens streamed per frontend CPU-second: the streaming capacity of one frontend process
(on this 2-core machine the load generator and the engine compete for the same cores, so the
raw tokens/s of a run is bounded by them, not by the frontend).

    .venv/bin/python benchmarks/frontend_overhead.py [--concurrency 1,16,128] [--requests-per-level 3]

Needs Redis on 127.0.0.1:6379 (the frontend discovers the engine there, as in production).
Writes benchmarks/results/frontend_overhead.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.loadgen import run_load  # noqa: E402
from workers.discovery import RedisDiscovery  # noqa: E402
from workers.process import EngineProcess  # noqa: E402
from workers.registry import get_backend  # noqa: E402
from workers.sim.backend import SIM_TOKENIZER_DIR as TOKENIZER_DIR  # noqa: E402
from workers.types import EngineLaunchConfig, WorkerInfo  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


async def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as c:
        while time.monotonic() < deadline:
            try:
                if (await c.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not ready")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,16,128")
    ap.add_argument("--requests-per-stream", type=int, default=4, help="requests = concurrency × this (min 32)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--speedup", type=float, default=1.0)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="kvyard-bench-"))
    eport, fport = 18411, 18412
    prefix = f"kvyard-bench-{uuid.uuid4().hex[:6]}"
    engine = EngineProcess(get_backend("sim"), EngineLaunchConfig(
        model="h200-llama3.1-8b", served_model_name="sim", port=eport, block_size=16, max_model_len=8192,
        kv_events_endpoint=f"ipc://{tmp}/kv.sock", kv_replay_endpoint=f"ipc://{tmp}/replay.sock",
        extra_args=["--speedup", str(args.speedup)]), tmp / "engine.log")
    engine.start()
    await engine.wait_healthy(60)
    disc = RedisDiscovery(args.redis_url, prefix=prefix)
    await disc.register(WorkerInfo(worker_id="sim-0", model="sim", backend="sim", url=engine.url, block_size=16,
                                   max_model_len=8192, tokenizer=str(TOKENIZER_DIR)), ttl_s=3600)
    fe = subprocess.Popen([sys.executable, "-m", "orchestrator", "--log-level", "warning", "frontend", "--port", str(fport),
                           "--redis-url", args.redis_url, "--discovery-prefix", prefix],
                          stdout=subprocess.DEVNULL, stderr=open(tmp / "frontend.log", "wb"))
    rows = []
    try:
        await wait_http(f"http://127.0.0.1:{fport}/health")
        prompt = "The quick brown fox jumps over the lazy dog. " * 12  # ~120 tokens
        await run_load(engine.url, "sim", 4, 8, prompt, 16)  # warm-up both paths
        await run_load(f"http://127.0.0.1:{fport}", "sim", 4, 8, prompt, 16)
        for conc in levels:
            n = max(32, conc * args.requests_per_stream)
            direct = await run_load(engine.url, "sim", conc, n, prompt, args.max_tokens)
            cpu0 = cpu_seconds(fe.pid)
            via = await run_load(f"http://127.0.0.1:{fport}", "sim", conc, n, prompt, args.max_tokens)
            fe_cpu = cpu_seconds(fe.pid) - cpu0
            d, v = direct.summary(), via.summary()
            tokens = sum(r.completion_tokens for r in via.results if r.ok)
            row = {
                "concurrency": conc, "requests": n, "direct": d, "frontend": v,
                "ttft_added_ms": {k: round(v["ttft_ms"][k] - d["ttft_ms"][k], 3) for k in ("p50", "p99")},
                "itl_ratio": {k: round(v["itl_ms"][k] / d["itl_ms"][k], 3) if d["itl_ms"][k] else None for k in ("p50", "p99")},
                "throughput_ratio": round(v["output_tok_per_s"] / d["output_tok_per_s"], 3),
                "frontend_cpu_s": round(fe_cpu, 3),
                "frontend_tokens_per_cpu_s": round(tokens / fe_cpu, 1) if fe_cpu > 0 else None,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        fe.terminate()
        fe.wait(10)
        await disc.deregister("sim-0")
        await disc.close()
        await engine.stop()
    RESULTS.mkdir(exist_ok=True)
    out = {"benchmark": "frontend_overhead", "max_tokens": args.max_tokens, "speedup": args.speedup,
           "machine": f"{os.cpu_count()} cores", "rows": rows}
    (RESULTS / "frontend_overhead.json").write_text(json.dumps(out, indent=2))
    lines = ["| conc | TTFT p50 direct → via (ms) | TTFT p99 direct → via | ITL p50 direct → via | ITL p99 ratio | throughput ratio | frontend tok per CPU-s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        d, v = r["direct"], r["frontend"]
        lines.append(f"| {r['concurrency']} | {d['ttft_ms']['p50']} → {v['ttft_ms']['p50']} | {d['ttft_ms']['p99']} → {v['ttft_ms']['p99']} | "
                     f"{d['itl_ms']['p50']} → {v['itl_ms']['p50']} | {r['itl_ratio']['p99']} | {r['throughput_ratio']} | {r['frontend_tokens_per_cpu_s']} |")
    (RESULTS / "frontend_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    asyncio.run(main())
