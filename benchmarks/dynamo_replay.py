"""Run NVIDIA Dynamo's offline replay (`dynamo.replay.run_trace_replay`, Dynamo 1.6.1) on a Mooncake trace and print
its summary as JSON: the Dynamo side of benchmarks/replay_compare.py and benchmarks/replay_speed.py.

Runs under Dynamo's own venv (scripts/install_dynamo.sh -> .venv-dynamo), not kvyard's. With --planner-config, Dynamo's
planner sizes the pool in its replay; its package imports `aisimulate` and `aisimulate_core` (not installable from PyPI:
the benchmarks put inert stand-ins on PYTHONPATH, enough for its load-based modes, which never call them) and needs
plotly, prometheus-api-client, pandas, pmdarima, filterpy and prophet in .venv-dynamo.
    .venv-dynamo/bin/python benchmarks/dynamo_replay.py --trace T.jsonl --workers 8 --router round_robin \
        --engine '{"engine": {"block_size": 64, "num_gpu_blocks": 16384, "timing_model": {...}}}' [--speedup 1]
Output (stdout, one JSON object): summary (Dynamo's, times in ms), wall_s (the call, measured here), cpu_s (user +
system seconds of the whole process, all threads), max_rss_mb.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", required=True)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--decode", type=int, default=0)
    ap.add_argument("--router", default="round_robin", choices=["round_robin", "kv_router"])
    ap.add_argument("--engine", default="{}", help="extra_engine_args as JSON")
    ap.add_argument("--router-config", default=None, help="KvRouterConfig keyword arguments as JSON")
    ap.add_argument("--speedup", type=float, default=1.0, help="arrival_speedup_ratio")
    ap.add_argument("--trace-block", type=int, default=512)
    ap.add_argument("--kv-event-lag-ms", type=float, default=None)
    ap.add_argument("--per-request", action="store_true", help="also return per-request ttft/itl/e2e (ms)")
    ap.add_argument("--planner-config", default=None, help="Dynamo PlannerConfig as JSON: its planner sizes the pool")
    args = ap.parse_args(argv)
    from dynamo.replay import run_trace_replay

    kw = {}
    if args.router_config:
        from dynamo._core import KvRouterConfig

        kw["router_config"] = KvRouterConfig(**json.loads(args.router_config))
    if args.prefill and args.decode:
        kw.update(num_prefill_workers=args.prefill, num_decode_workers=args.decode)
    eng = json.loads(args.engine)
    t0 = time.perf_counter()
    if args.planner_config:
        kw["planner_config"] = json.loads(args.planner_config)
    r = run_trace_replay([args.trace], extra_engine_args=eng or None, num_workers=args.workers, router_mode=args.router,
                         arrival_speedup_ratio=args.speedup, trace_block_size=args.trace_block,
                         kv_event_lag_ms=args.kv_event_lag_ms, capture_per_request=args.per_request, **kw)
    wall = time.perf_counter() - t0
    u = resource.getrusage(resource.RUSAGE_SELF)
    out = {"summary": r.summary, "wall_s": wall, "cpu_s": u.ru_utime + u.ru_stime, "max_rss_mb": u.ru_maxrss / 1024.0}
    if args.per_request and r.per_request:
        out["per_request"] = [{"arrival_ms": p["arrival_time_ms"], "first_token_ms": p["first_token_ms"], "ttft_ms": p["ttft_ms"],
                               "itl_ms": p["itl_ms"], "e2e_ms": p["e2e_latency_ms"], "output_length": p["output_length"],
                               "reused": p["reused_input_tokens"], "worker": p["decode_worker_idx"]} for p in r.per_request]
    if r.planner is not None:
        out["planner"] = {"total_ticks": r.planner.total_ticks, "metadata": r.planner.metadata,
                          "scaling_events": [{"at_s": e.at_s, "component": e.component, "from": e.from_count, "to": e.to_count,
                                              "reason": e.reason} for e in r.planner.scaling_events]}
    json.dump(out, sys.stdout, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
