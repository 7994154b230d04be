"""`kvyard replay`: replay a trace or a synthetic load through kvyard's routers, sim engines and planner on a
virtual clock (docs/replay.md).

    kvyard replay --trace benchmarks/data/mooncake_conversation_trace.jsonl --workers 16 --policy kv,round-robin
    kvyard replay --synthetic daily:minutes=60,peak=30 --planner planner.yaml --slo-ttft-p90 1000 --slo-itl-p90 25
    kvyard replay --trace T.jsonl --find-min-workers --slo-ttft-p90 800 --slo-itl-p90 30

Flags override `--config` (a YAML of ReplayConfig keys: engine, frontend, workers, prefill, decode, ...).
Errors in the trace, the spec or the config exit with "kvyard replay: ..." and status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

__all__ = ["add_replay_parser", "run_replay_command"]


def add_replay_parser(sub) -> argparse.ArgumentParser:
    rp = sub.add_parser("replay", help="replay a trace through the router, sim engines and planner on a virtual clock",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = rp.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="Mooncake JSONL (timestamp|delay, input_length, output_length, hash_ids)")
    src.add_argument("--synthetic", help="KIND:key=value,... with KIND poisson | shared-prefix | sessions | daily | walk")
    rp.add_argument("--requests", type=int, default=None, help="trace: the first N rows (after --skip)")
    rp.add_argument("--skip", type=int, default=0, help="trace: rows to skip")
    rp.add_argument("--time-scale", type=float, default=1.0, help="trace times are divided by this (2: twice the request rate)")
    rp.add_argument("--osl-scale", type=float, default=1.0, help="trace: output lengths are multiplied by this (rounded up)")
    rp.add_argument("--workers", type=int, default=None, help="aggregated workers (default 8)")
    rp.add_argument("--prefill", type=int, default=None, help="P/D: prefill workers (with --decode)")
    rp.add_argument("--decode", type=int, default=None, help="P/D: decode workers (with --prefill)")
    rp.add_argument("--policy", default=None, help="routing policy, or a comma list to compare (default: the frontend's, kv)")
    rp.add_argument("--planner", type=Path, default=None, help="`kvyard planner` YAML: kvyard's planner sizes the pools")
    rp.add_argument("--profile", default=None, help="bundled profile name, profile directory, or a mocker-format NPZ")
    rp.add_argument("--block-size", type=int, default=None)
    rp.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks per worker (default: the profile's capacity)")
    rp.add_argument("--max-num-seqs", type=int, default=None)
    rp.add_argument("--max-num-batched-tokens", type=int, default=None)
    rp.add_argument("--max-model-len", type=int, default=None)
    rp.add_argument("--prefill-pricing", choices=["profile", "new-tokens"], default=None)
    rp.add_argument("--event-lag-ms", type=float, default=None, help="KV events reach the router this much later (default 0)")
    rp.add_argument("--startup-s", type=float, default=None, help="planner-added workers serve this long after the request (default 60)")
    rp.add_argument("--slo-ttft-p90", type=float, default=None, metavar="MS")
    rp.add_argument("--slo-itl-p90", type=float, default=None, metavar="MS")
    rp.add_argument("--find-min-workers", action="store_true", help="search the smallest fleet (per pool for P/D) meeting the SLO")
    rp.add_argument("--max-workers", type=int, default=256, help="--find-min-workers: upper end of the search")
    rp.add_argument("--config", type=Path, default=None, help="YAML of ReplayConfig keys (flags win)")
    rp.add_argument("--seed", type=int, default=7, help="synthetic loads and the routers' random tie-breaks")
    rp.add_argument("--json", type=Path, default=None, help="write the results here")
    rp.add_argument("--plot", type=Path, default=None, help="write a PNG here (TTFT CDF; replicas and SLA over time)")
    rp.add_argument("--no-bound", action="store_true", help="skip the fleet bound on hits (a Belady pass over the workload)")
    rp.add_argument("--no-progress", action="store_true")
    return rp


def _config(ns: argparse.Namespace):
    from orchestrator.config import load_yaml
    from orchestrator.replay.config import ReplayConfig

    data = load_yaml(ns.config) if ns.config else {}
    engine = dict(data.get("engine") or {})
    for flag, key in (("profile", "profile"), ("block_size", "block_size"), ("num_gpu_blocks", "num_gpu_blocks"),
                      ("max_num_seqs", "max_num_seqs"), ("max_num_batched_tokens", "max_num_batched_tokens"),
                      ("max_model_len", "max_model_len"), ("prefill_pricing", "prefill_pricing")):
        if getattr(ns, flag) is not None:
            engine[key] = getattr(ns, flag)
    data["engine"] = engine
    for flag, key in (("workers", "workers"), ("prefill", "prefill"), ("decode", "decode"), ("event_lag_ms", "event_lag_ms"),
                      ("startup_s", "startup_s"), ("slo_ttft_p90", "slo_ttft_p90_ms"), ("slo_itl_p90", "slo_itl_p90_ms")):
        if getattr(ns, flag) is not None:
            data[key] = getattr(ns, flag)
    if ns.prefill or ns.decode:
        data.setdefault("workers", 0)
    data.setdefault("seed", ns.seed)
    if ns.planner is not None:
        data["planner"] = load_yaml(ns.planner)
    return ReplayConfig(**data)


def with_policy(cfg, policy: str):
    """The replay config with the frontend routing by `policy` (its other router settings kept)."""
    fe = cfg.frontend
    return cfg.model_copy(update={"frontend": fe.model_copy(update={"router": fe.router.model_copy(update={"policy": policy})})})


def _workload(ns: argparse.Namespace):
    from orchestrator.replay.workload import load_mooncake, synthetic

    if ns.trace is not None:
        return load_mooncake(ns.trace, ns.time_scale, ns.requests, ns.skip, osl_scale=ns.osl_scale)
    return synthetic(ns.synthetic, ns.seed)


def run_replay_command(ns: argparse.Namespace) -> int:
    from rich.console import Console

    from orchestrator.replay.workload import WorkloadError

    console = Console(stderr=True)
    try:
        cfg = _config(ns)
        wl = _workload(ns)
    except (WorkloadError, ValidationError, ValueError, OSError) as exc:
        console.print(f"kvyard replay: {exc}")
        return 2
    policies = [p.strip() for p in ns.policy.split(",")] if ns.policy else [cfg.frontend.router.policy]
    from router import policy_names

    bad = [p for p in policies if p not in policy_names()]
    if bad:
        console.print(f"kvyard replay: unknown policy {', '.join(bad)}; known: {', '.join(policy_names())}")
        return 2
    stats = wl.stats()
    console.print(f"[bold]kvyard replay[/bold]: {wl.description}; {stats['requests']:,} requests over {stats['duration_s']:,} s, "
                  f"ISL mean {stats['isl_mean']:,}, OSL mean {stats['osl_mean']:,}")
    try:
        if ns.find_min_workers:
            out = _find(ns, cfg, wl, policies[0], console)
        else:
            out = _runs(ns, cfg, wl, policies, console)
    except ValueError as exc:
        console.print(f"kvyard replay: {exc}")
        return 2
    if ns.json is not None:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(out, indent=1, default=str))
        console.print(f"wrote {ns.json}")
    return 0


def _out():
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)  # piped: the whole table on one line per run


def _progress(console, total: int, enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("virtual {task.fields[vt]}"),
                    TimeElapsedColumn(), console=console, disable=not enabled, transient=True)


def _runs(ns, cfg, wl, policies: list[str], console) -> dict:
    from orchestrator.replay.bound import fleet_bound
    from orchestrator.replay.planning import PlannerDriver
    from orchestrator.replay.report import plot, result_of, summary_table
    from orchestrator.replay.runner import Replay

    bound = None
    if not ns.no_bound and cfg.planner is None:
        n = cfg.prefill if cfg.disaggregated else cfg.workers
        replay0 = Replay(cfg, wl)
        bound = fleet_bound(wl, cfg.engine.block_size, max(1, n) * (replay0.num_gpu_blocks - 1))
    results = []
    show = not ns.no_progress and sys.stderr.isatty()
    with _progress(console, len(wl), show) as prog:
        for policy in policies:
            c = with_policy(cfg, policy)
            task = prog.add_task(policy, total=len(wl), vt="0 s")
            r = Replay(c, wl, progress=lambda rp, t=task: prog.update(t, completed=rp.arrived, vt=f"{rp.clock.now:,.0f} s"))
            if c.planner is not None:
                PlannerDriver(r, c.planner)
            r.run()
            results.append(result_of(r, policy + (" + planner" if c.planner else ""), bound if bound is not None else False))
    _out().print(summary_table(results, f"kvyard replay — {wl.description}"))
    if ns.plot is not None:
        ns.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(results, ns.plot, f"kvyard replay — {wl.description}")
        console.print(f"wrote {ns.plot}")
    if ns.json is None:
        for r in results:
            r.pop("ttft_s", None)
    return {"workload": {**wl.stats(), "description": wl.description, "meta": wl.meta}, "config": cfg.model_dump(mode="json"),
            "fleet_bound": bound, "runs": results}


def _find(ns, cfg, wl, policy: str, console) -> dict:
    from rich.table import Table

    from orchestrator.replay.search import find_min_workers

    c = with_policy(cfg, policy)
    if not c.disaggregated:
        c = c.model_copy(update={"workers": max(c.workers, 1)})

    def said(p: dict) -> None:
        fleet = f"{p['prefill']}P+{p['decode']}D" if c.disaggregated else f"{p['workers']}"
        console.print(f"  {fleet:>10}: TTFT p90 {p['ttft_p90_ms']} ms, ITL p90 {p['itl_p90_ms']} ms -> "
                      f"{'meets' if p['ok'] else 'misses'} ({p['wall_s']} s)")

    res = find_min_workers(c, wl, ns.max_workers, said)
    t = Table(title=f"smallest fleet meeting TTFT p90 <= {c.slo_ttft_p90_ms} ms, ITL p90 <= {c.slo_itl_p90_ms} ms ({policy})")
    for col in ("fleet", "TTFT p90", "ITL p90", "meets", "GPU-s"):
        t.add_column(col, justify="right")
    for p in sorted(res["probes"], key=lambda p: (p["prefill"], p["decode"], p["workers"])):
        fleet = f"{p['prefill']}P+{p['decode']}D" if c.disaggregated else str(p["workers"])
        t.add_row(fleet, str(p["ttft_p90_ms"]), str(p["itl_p90_ms"]), "yes" if p["ok"] else "no", f"{p['gpu_seconds']:,.0f}")
    _out().print(t)
    _out().print(f"found: {res['found'] or 'none within --max-workers'}")
    return {"workload": {**wl.stats(), "description": wl.description}, "config": c.model_dump(mode="json"), "search": res}
