"""Tracing off vs on: the same streaming load through kvyard frontends side by side, in one run.

One sim engine; frontend "off" with tracing off (the default), frontend "on" with tracing on, exporting every span
over OTLP/gRPC to a receiver in this process (orchestrator/testing/otlp_receiver.py), so the export's own cost is
counted; with `--baseline DIR`, a third frontend runs the code of DIR (a tree without the tracing hooks, e.g.
`git archive <commit> | tar -x -C DIR`, with router/_kvcore*.so copied in), so "off" is compared with no hooks at
all. Each round runs every frontend once, in a rotated order, at each concurrency; each run records TTFT and ITL
p50/p99 and the frontend process's CPU time, reported as streamed output tokens per frontend CPU-second. The
results are ratios per round (on/off, off/baseline) and their spread (the machine's noise).

    .venv/bin/python benchmarks/tracing_overhead.py [--baseline DIR] [--concurrency 1,32] [--rounds 3] [--max-tokens 64]

Needs Redis on 127.0.0.1:6379 (the frontends discover the engine there). Writes
benchmarks/results/tracing_overhead.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.frontend_overhead import cpu_seconds, wait_http  # noqa: E402
from benchmarks.loadgen import run_load  # noqa: E402
from orchestrator.testing import free_port  # noqa: E402
from orchestrator.testing.otlp_receiver import OtlpReceiver  # noqa: E402
from workers.discovery import RedisDiscovery  # noqa: E402
from workers.process import EngineProcess  # noqa: E402
from workers.registry import get_backend  # noqa: E402
from workers.sim.backend import SIM_TOKENIZER_DIR  # noqa: E402
from workers.types import EngineLaunchConfig, WorkerInfo  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def frontend(port: int, redis_url: str, prefix: str, log: Path, otlp: str | None, tree: Path | None = None) -> subprocess.Popen:
    tracing = ["--tracing", "--otlp-traces-endpoint", otlp] if otlp else []
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree is not None else None  # the baseline's code, this venv's packages
    return subprocess.Popen([sys.executable, "-m", "orchestrator", "--log-level", "warning", "frontend", "--port", str(port),
                             "--grpc-port", "0", "--redis-url", redis_url, "--discovery-prefix", prefix, *tracing],
                            stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env=env, cwd=str(tree) if tree is not None else None)


async def measure(url: str, pid: int, conc: int, n: int, prompt: str, max_tokens: int) -> dict:
    cpu0 = cpu_seconds(pid)
    load = await run_load(url, "sim", conc, n, prompt, max_tokens)
    cpu = cpu_seconds(pid) - cpu0
    s = load.summary()
    tokens = sum(r.completion_tokens for r in load.results if r.ok)
    return {"ok": sum(r.ok for r in load.results), "requests": n, "ttft_ms": s["ttft_ms"], "itl_ms": s["itl_ms"],
            "frontend_cpu_s": round(cpu, 3), "tokens_per_cpu_s": round(tokens / cpu, 1) if cpu > 0 else None}


def hook_cost_off_ns(repeat: int = 200_000) -> float:
    """What tracing off adds to one request: the hooks the request path calls (tokenize, admission, annotate,
    route, one engine attempt, the access-log notes), timed with tracing off and the access log off."""
    import timeit

    from orchestrator import access_log
    from orchestrator.tracing import Tracing
    from router import Endpoint, RoutingDecision

    t = Tracing.off()
    ep = Endpoint(worker_id="w", url="http://127.0.0.1:1", model="m")
    decision = RoutingDecision([ep], {"w": 0.0}, "kv")
    headers = {"content-type": "application/json", "x-request-id": "r"}

    def one() -> None:
        with t.span("kvyard.tokenize"):
            pass
        with t.span("kvyard.admission"):
            pass
        t.annotate(**{"kvyard.request_id": "r", "kvyard.model": "m", "kvyard.prompt_tokens": 1})
        t.route(decision, 1, 0.0)
        _, span = t.attempt(ep, 0, headers)
        t.end_attempt(span, None)
        access_log.note(request_id="r", model="m", worker="w", prompt_tokens=1, key_id=None, cached_tokens=0, queue_s=0.0)
        access_log.note(output_tokens=1, ttft_at=None)

    return min(timeit.repeat(one, number=repeat, repeat=5)) / repeat * 1e9


def spread(xs: list[float]) -> str:
    return f"{min(xs):.3f}–{max(xs):.3f} (median {statistics.median(xs):.3f})"


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64, help="requests per run (at least 8 × concurrency)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--baseline", type=Path, default=None, help="a source tree without the tracing hooks, run as a third frontend")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="kvyard-tracing-bench-"))
    prefix = f"kvyard-bench-{uuid.uuid4().hex[:6]}"
    engine = EngineProcess(get_backend("sim"), EngineLaunchConfig(
        model="h200-llama3.1-8b", served_model_name="sim", port=free_port(), block_size=16, max_model_len=8192), tmp / "engine.log")
    engine.start()
    await engine.wait_healthy(60)
    disc = RedisDiscovery(args.redis_url, prefix=prefix)
    await disc.register(WorkerInfo(worker_id="sim-0", model="sim", backend="sim", url=engine.url, block_size=16, max_model_len=8192,
                                   tokenizer=str(SIM_TOKENIZER_DIR)), ttl_s=3600)
    rows: list[dict] = []
    with OtlpReceiver() as rx:
        ports = {"off": free_port(), "on": free_port(), **({"base": free_port()} if args.baseline else {})}
        procs = {k: frontend(p, args.redis_url, prefix, tmp / f"frontend-{k}.log", rx.endpoint if k == "on" else None,
                             args.baseline.resolve() if k == "base" else None)
                 for k, p in ports.items()}
        try:
            for p in ports.values():
                await wait_http(f"http://127.0.0.1:{p}/health")
            prompt = "The quick brown fox jumps over the lazy dog. " * 12  # ~120 tokens
            for p in ports.values():  # warm-up
                await run_load(f"http://127.0.0.1:{p}", "sim", 4, 8, prompt, 16)
            for conc in levels:
                n = max(args.requests, 8 * conc)
                names = list(ports)
                for rnd in range(args.rounds):
                    order = names[rnd % len(names):] + names[:rnd % len(names)]  # each frontend first once per len(names) rounds
                    got = {}
                    for k in order:
                        got[k] = await measure(f"http://127.0.0.1:{ports[k]}", procs[k].pid, conc, n, prompt, args.max_tokens)
                    off, on = got["off"], got["on"]
                    row = {"concurrency": conc, "round": rnd, "order": list(order), "off": off, "on": on,
                           "ttft_p50_ratio": round(on["ttft_ms"]["p50"] / off["ttft_ms"]["p50"], 3),
                           "ttft_p99_ratio": round(on["ttft_ms"]["p99"] / off["ttft_ms"]["p99"], 3),
                           "itl_p50_ratio": round(on["itl_ms"]["p50"] / off["itl_ms"]["p50"], 3) if off["itl_ms"]["p50"] else None,
                           "tokens_per_cpu_ratio": round(on["tokens_per_cpu_s"] / off["tokens_per_cpu_s"], 3)}
                    if "base" in got:
                        base = row["base"] = got["base"]
                        row["off_vs_base"] = {"ttft_p50": round(off["ttft_ms"]["p50"] / base["ttft_ms"]["p50"], 3),
                                              "ttft_p99": round(off["ttft_ms"]["p99"] / base["ttft_ms"]["p99"], 3),
                                              "tokens_per_cpu": round(off["tokens_per_cpu_s"] / base["tokens_per_cpu_s"], 3)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            for proc in procs.values():
                proc.terminate()
                proc.wait(10)
            await disc.deregister("sim-0")
            await disc.close()
            await engine.stop()
        spans = len(rx.spans)
    RESULTS.mkdir(exist_ok=True)
    summary = {}
    for conc in levels:
        rs = [r for r in rows if r["concurrency"] == conc]
        summary[conc] = {k: [r[k] for r in rs] for k in ("ttft_p50_ratio", "ttft_p99_ratio", "itl_p50_ratio", "tokens_per_cpu_ratio")}
        summary[conc]["ttft_p50_ms_off"] = [r["off"]["ttft_ms"]["p50"] for r in rs]
        summary[conc]["ttft_p50_ms_on"] = [r["on"]["ttft_ms"]["p50"] for r in rs]
        summary[conc]["tokens_per_cpu_s_off"] = [r["off"]["tokens_per_cpu_s"] for r in rs]
        summary[conc]["tokens_per_cpu_s_on"] = [r["on"]["tokens_per_cpu_s"] for r in rs]
        if args.baseline:
            summary[conc]["off_vs_base"] = {k: [r["off_vs_base"][k] for r in rs] for k in ("ttft_p50", "ttft_p99", "tokens_per_cpu")}
            summary[conc]["ttft_p50_ms_base"] = [r["base"]["ttft_ms"]["p50"] for r in rs]
            summary[conc]["tokens_per_cpu_s_base"] = [r["base"]["tokens_per_cpu_s"] for r in rs]
    hooks_ns = round(hook_cost_off_ns(), 1)
    out = {"benchmark": "tracing_overhead", "max_tokens": args.max_tokens, "rounds": args.rounds, "machine": f"{os.cpu_count()} cores",
           "baseline": str(args.baseline) if args.baseline else None,
           "spans_exported_by_the_traced_frontend": spans, "hook_cost_off_ns_per_request": hooks_ns, "rows": rows, "summary": summary}
    (RESULTS / "tracing_overhead.json").write_text(json.dumps(out, indent=2))
    lines = ["| conc | TTFT p50 off → on (ms), per round | TTFT p50 on/off | TTFT p99 on/off | ITL p50 on/off | frontend tok per CPU-s off → on | tok per CPU-s on/off |",
             "|---|---|---|---|---|---|---|"]
    for conc, s in summary.items():
        ttft = ", ".join(f"{a} → {b}" for a, b in zip(s["ttft_p50_ms_off"], s["ttft_p50_ms_on"]))
        tok = ", ".join(f"{a} → {b}" for a, b in zip(s["tokens_per_cpu_s_off"], s["tokens_per_cpu_s_on"]))
        lines.append(f"| {conc} | {ttft} | {spread(s['ttft_p50_ratio'])} | {spread(s['ttft_p99_ratio'])} | "
                     f"{spread([x for x in s['itl_p50_ratio'] if x is not None])} | {tok} | {spread(s['tokens_per_cpu_ratio'])} |")
    if args.baseline:
        lines += ["", "Tracing off against the code without the hooks (baseline):", "",
                  "| conc | TTFT p50 baseline → off (ms), per round | TTFT p50 off/baseline | TTFT p99 off/baseline | frontend tok per CPU-s baseline → off | tok per CPU-s off/baseline |",
                  "|---|---|---|---|---|---|"]
        for conc, s in summary.items():
            ttft = ", ".join(f"{a} → {b}" for a, b in zip(s["ttft_p50_ms_base"], s["ttft_p50_ms_off"]))
            tok = ", ".join(f"{a} → {b}" for a, b in zip(s["tokens_per_cpu_s_base"], s["tokens_per_cpu_s_off"]))
            ob = s["off_vs_base"]
            lines.append(f"| {conc} | {ttft} | {spread(ob['ttft_p50'])} | {spread(ob['ttft_p99'])} | {tok} | {spread(ob['tokens_per_cpu'])} |")
    lines.append(f"\nSpans received from the traced frontend: {spans}. Tracing off, the request path's hooks cost "
                 f"{hooks_ns} ns per request (timeit, best of 5).")
    (RESULTS / "tracing_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(summary, RESULTS / "tracing_overhead.png")


def plot(summary: dict, path: Path) -> None:
    """Each point one round: tracing on / off (dots) and, with a baseline, off / baseline (crosses)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, base_key, title in ((axes[0], "ttft_p50_ratio", "ttft_p50", "TTFT p50 ratio"),
                                     (axes[1], "tokens_per_cpu_ratio", "tokens_per_cpu", "frontend tokens per CPU-second ratio")):
        for i, (conc, s) in enumerate(summary.items()):
            ax.scatter([i - 0.08] * len(s[key]), s[key], color="tab:red", label="tracing on / off" if i == 0 else None)
            if "off_vs_base" in s:
                ys = s["off_vs_base"][base_key]
                ax.scatter([i + 0.08] * len(ys), ys, color="tab:blue", marker="x", label="off / no hooks" if i == 0 else None)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(summary)), [f"concurrency {c}" for c in summary])
        ax.set_xlim(-0.5, len(summary) - 0.5)
        ax.set_title(title)
        ax.set_ylabel("ratio (each point: one round)")
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    asyncio.run(main())
