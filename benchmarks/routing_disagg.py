"""Prefill routing in disaggregated serving: the kv cost's reuse credit on the prefill pool, A/B on the trace.

    .venv/bin/python benchmarks/routing_disagg.py [--prefill-workers 4 --decode-workers 4 --reuse-weights 1,16]

The aggregated router's reuse credit (`kv_reuse_weight`, router/plugins/kv.py) was measured on 8 aggregated
workers (routing_reuse*.md). In P/D serving the prefill pool is where a prefix recomputed elsewhere costs
compute, so the prefill router takes the same cost; this measures that choice instead of assuming it.

Each run: `kvyard up --prefill-workers P --decode-workers D` over sim engines (vLLM flavor, its NIXL-style
hand-off), `--disagg-mode always` (every request prefilled on the prefill pool, so the prefill hit rate is
the whole fleet's prompt reuse), the frontend's `disagg.prefill_reuse_weight` set per run. The workload,
schedule, client and time base are benchmarks/routing.py's (Mooncake trace, hash ids → 512-token blocks,
open loop, latencies in the engines' profile time). Hit rate = Δ`vllm:prefix_cache_hits_total` /
Δ`vllm:prefix_cache_queries_total` over the prefill engines only; its bound is routing.py's fleet bound
over the prefill pool's capacity (P × (num_gpu_blocks − 1), Belady). Rounds alternate the weights, a
fresh cluster per run; rows are medians, per-round values listed.

Writes benchmarks/results/<out>.json and .md (default routing_disagg).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.routing import (TRACE, Cluster, cache_references, engine_counters, fmt, median_run, replay,  # noqa: E402
                                trace_workload)

RESULTS = ROOT / "benchmarks" / "results"


class DisaggCluster(Cluster):
    """`kvyard up` with a prefill and a decode pool; ready when every worker is, the prefill engines' ports read back
    (counters are read from the prefill pool only)."""

    def __init__(self, args, reuse: float, tmp: Path) -> None:
        self.reuse = reuse
        self.setup(args, "kv", tmp, f"pd-reuse{reuse:g}", args.num_gpu_blocks,
                   ["--prefill-workers", str(args.prefill_workers), "--decode-workers", str(args.decode_workers),
                    "--flavor", "vllm", "--disagg-mode", "always"], {"disagg": {"prefill_reuse_weight": reuse}})

    start_timeout_s = 180.0

    def ready_ports(self, cluster: dict) -> list[int] | None:
        ready = [w for w in cluster["workers"] if w["state"] == "ready" and w["running"] is not None]
        if len(ready) == self.args.prefill_workers + self.args.decode_workers:
            return sorted(httpx.URL(w["url"]).port for w in ready if w["role"] == "prefill")
        return None


def disagg_decisions(text: str) -> dict[str, float]:
    """kvyard_disagg_decisions_total by mode (remote, local, fallback, retry, ...), summed over reasons."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvyard_disagg_decisions_total{"):
            labels, val = line[len("kvyard_disagg_decisions_total{"):].rsplit("} ", 1)
            mode = dict(p.split("=", 1) for p in labels.split(","))["mode"].strip('"')
            out[mode] = out.get(mode, 0.0) + float(val)
    return out


async def run_one(args, reuse: float, workload: list[dict], tmp: Path, label: str) -> dict:
    print(f"[{label}] prefill reuse {reuse:g}: starting {args.prefill_workers}P{args.decode_workers}D…", flush=True)
    async with DisaggCluster(args, reuse, tmp) as cl:
        async with httpx.AsyncClient(timeout=10) as c:
            before = await engine_counters(c, cl.ports)
            la0 = os.getloadavg()[0]
            res = await replay(f"http://127.0.0.1:{args.port}", workload, args.speedup)
            await asyncio.sleep(1.5)
            after = await engine_counters(c, cl.ports)
            decisions = disagg_decisions((await c.get(f"http://127.0.0.1:{args.port}/metrics")).text)
    dh, dq = after["hits"] - before["hits"], after["queries"] - before["queries"]
    res.update({"reuse_weight": reuse, "prefill_hits_tokens": dh, "prefill_queries_tokens": dq,
                "hit_rate": round(dh / dq, 4) if dq else None, "disagg_decisions": decisions,
                "loadavg_start": round(la0, 2), "loadavg_end": round(os.getloadavg()[0], 2)})
    print(f"[{label}] reuse {reuse:g}: TTFT {res['ttft_ms']} ITL p50 {res['itl_ms']['p50']} hit {res['hit_rate']} "
          f"ok {res['ok']}/{res['requests']} decisions {decisions}", flush=True)
    return res


def write_report(out: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    clean = json.loads(json.dumps(out, default=float))
    for r in clean["runs"].values():
        r.pop("_ttft_all", None)
    (RESULTS / f"{out['params']['out']}.json").write_text(json.dumps(clean, indent=1) + "\n")
    p, runs, bound = out["params"], out["runs"], out["fleet_bound"]["hit_rate"]
    L = [f"# Prefill routing under disaggregation: reuse credit A/B ({p['prefill_workers']}P{p['decode_workers']}D sim workers)", "",
         f"Run {out['when']} on {out['machine']}; load average {out['loadavg']['start']} at start, {out['loadavg']['end']} at the "
         f"end (the box is shared). Latencies in the engines' profile time (H200 Llama-3.1-8B-FP8 profile; wall × speed-up "
         f"{p['speedup']:g}).", "", "```", out["command"], "```", "",
         f"First {out['workload']['requests']} requests of the Mooncake conversation trace (benchmarks/data/), arrivals "
         f"compressed {p['compression']:g}×: {out['workload']['rate_profile']:.1f} req/s profile; ISL mean "
         f"{out['workload']['isl_mean']:,.0f}. `--disagg-mode always`: every request prefilled on the prefill pool, "
         f"decoded on the decode pool (vLLM-flavor hand-off). {p['num_gpu_blocks']} KV blocks per worker. Hit rate over "
         "the prefill engines; bound = routing.py's fleet bound over the prefill pool's capacity.", "",
         "| prefill reuse weight | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | req/s | prefill hit rate | % of bound | errors |",
         "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs.values():
        L.append(f"| {r['reuse_weight']:g} | {fmt(r['ttft_ms']['p50'])} | {fmt(r['ttft_ms']['p90'])} | {fmt(r['ttft_ms']['p99'])} | "
                 f"{fmt(r['itl_ms']['p50'], 2)} | {fmt(r['req_per_s'], 2)} | {fmt(100 * (r['hit_rate'] or 0))}% | "
                 f"{fmt(100 * (r['hit_rate'] or 0) / bound)}% | {r['errors']} |")
    L.append(f"| bound (pooled prefill capacity, Belady) | | | | | | {fmt(100 * bound)}% | 100.0% | |")
    if any(r.get("rounds") for r in runs.values()):
        L += ["", f"Rows are medians over {p['repeats']} rounds (the weights alternate within a round, a fresh cluster "
              "per run). Per round, TTFT p90 ms / prefill hit rate:", ""]
        for r in runs.values():
            L.append(f"- reuse {r['reuse_weight']:g}: " + "; ".join(f"{fmt(x['ttft_ms']['p90'])} / {fmt(100 * x['hit_rate'])}%"
                                                                   for x in r["rounds"]))
    names = list(runs)
    if len(names) == 2:
        a, b = (runs[n] for n in names)
        L += ["", f"reuse {b['reuse_weight']:g} / reuse {a['reuse_weight']:g}: TTFT p90 **{b['ttft_ms']['p90'] / a['ttft_ms']['p90']:.3f}×**, "
              f"p50 {b['ttft_ms']['p50'] / a['ttft_ms']['p50']:.3f}×, prefill hit rate **{(b['hit_rate'] or 0) / max(1e-9, a['hit_rate'] or 0):.3f}×**."]
    (RESULTS / f"{p['out']}.md").write_text("\n".join(L) + "\n")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill-workers", type=int, default=4)
    ap.add_argument("--decode-workers", type=int, default=4)
    ap.add_argument("--reuse-weights", default="1,16", help="prefill router reuse weights, one run each per round")
    ap.add_argument("--speedup", type=float, default=0.25)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--port", type=int, default=18690)
    ap.add_argument("--base-port", type=int, default=18700)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--compression", type=float, default=4.0, help="trace time / profile time")
    ap.add_argument("--osl-scale", type=float, default=0.25)
    ap.add_argument("--num-gpu-blocks", type=int, default=59064, help="per worker (the H200's, as routing_repeats)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="routing_disagg")
    return ap


async def amain(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvyard-routing-disagg-"))
    wl = trace_workload(args.trace, args.requests, args.compression, args.osl_scale)
    span = wl[-1]["t"]
    refs = cache_references(wl, argparse.Namespace(block_size=args.block_size, workers=args.prefill_workers), args.num_gpu_blocks)
    out = {"benchmark": "routing_disagg", "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}", "loadavg": {"start": round(os.getloadavg()[0], 2)},
           "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "workload": {"requests": len(wl), "rate_profile": len(wl) / span if span else None,
                        "isl_mean": float(np.mean([len(w["prompt"]) for w in wl]))},
           "fleet_bound": refs["fleet_bound"], "oracle": refs["oracle"]}
    weights = [float(w) for w in args.reuse_weights.split(",") if w]
    per: dict[str, list[dict]] = {f"reuse {w:g}": [] for w in weights}
    for rnd in range(max(1, args.repeats)):
        order = weights if rnd % 2 == 0 else weights[::-1]  # alternate, so neither weight always runs first
        for w in order:
            per[f"reuse {w:g}"].append(await run_one(args, w, wl, tmp, f"round {rnd + 1}/{args.repeats}"))
    out["runs"] = {k: median_run(v) for k, v in per.items()}
    out["loadavg"]["end"] = round(os.getloadavg()[0], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = asyncio.run(amain(args))
    out["command"] = "benchmarks/routing_disagg.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
