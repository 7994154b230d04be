"""Planner benchmark on `kvyard replay`: kvyard's planner, Dynamo's planner, static at peak and the oracle, on the same
engines and loads; minutes within the SLA and GPU-seconds.

    python -m benchmarks planner [--loads mooncake,daily,walk,walk2] [--sweep demand_z=0,0.64,2.5] [--out planner_sim]
    .venv/bin/python benchmarks/planner_sim.py [same flags]

Every run serves the same JSONL through an aggregated pool of engines on the mocker's terms (the bundled H200 profile
through Dynamo's converter, Dynamo's mocker step timing; block size 64, 16,384 KV blocks per worker), so kvyard's replay
and Dynamo's replay run the same engines (benchmarks/results/replay_agreement.md). New workers serve --startup seconds
after the scale-up request and are billed from it; removed ones drain (billed until their last request ends).
    kvyard     kvyard's PlannerLoop in kvyard replay (orchestrator/replay/planning.py): the frontend's telemetry, a tick
               every --interval s, hybrid mode with the peak_trend predictor (the planner's defaults otherwise;
               lookahead = start-up, scale-down cooldown --cooldown s, stabilisation window --down-window s, step --max-step)
    dynamo     Dynamo 1.6.1's planner in Dynamo's own replay (`run_trace_replay(planner_config=...)`): mode agg, its default
               optimization target "throughput" (load-based thresholds on queue and KV use, a 5 s load loop; its
               SLA target needs AISimulate, which does not install here, so its SLA mode is not run); min 1 endpoint,
               a GPU budget above anything the load needs; engines with the same start-up time
    static     the smallest fixed fleet that meets every minute (found by the sweep below)
    oracle     knows the future: each minute, the smallest fleet whose fixed-size run met that minute (a sweep of fixed
               fleets 1..static), kept through a dip no longer than the start-up, ready on time (its start-up billed)
A minute is within the SLA when the TTFT p90 of the requests whose first token came in it is <= --ttft and the
token-weighted p90 of their mean inter-token latencies is <= --itl: the same function on both replays' per-request
records. Every policy starts with the oracle's first-minute fleet.
Loads (files in a temp dir; bodies are the conversation trace's: lengths and prefix sharing):
    mooncake   the conversation trace at --mooncake-scale × its rate
    daily      synthetic daily (orchestrator/replay/workload.py): --daily-minutes, trough --daily-trough to peak --daily-peak
               req/s, 3 bursts ×1.6 for 3 min; bodies drawn from the trace
    walk       synthetic walk, a shape nobody tuned to (a seeded random walk of the rate with two flash crowds): chosen and
               fixed before any planner ran on it, and no setting was changed after
    walk2      a second untuned shape, added after the planner's sizing was reworked on the three above and not run before
               that: another seed, a rate redrawn every minute (σ 0.35) with three ×1.5 crowds, and its own SLA
               (--walk2-ttft / --walk2-itl), so a different fleet
kvyard's planner also runs at the --sweep settings (default: its demand_z, the z of the forecast error it sizes for, at
0, 0.64, 2.5 beside the default 1.28): its cost/SLA trade-off, beside Dynamo's points, in the same run.
Writes benchmarks/results/planner_sim.{json,md}, planner_sim_<load>.png and planner_sim_pareto.png.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.dynamo_compare import convert_profile  # noqa: E402
from benchmarks.replay_compare import RESULTS, TRACE, dynamo_run, dynamo_standins, machine, mocker_engine  # noqa: E402
from orchestrator.config import FrontendConfig  # noqa: E402
from orchestrator.replay import EngineSpec, Replay, ReplayConfig, load_mooncake, synthetic  # noqa: E402
from orchestrator.replay.planning import PlannerDriver  # noqa: E402

MODEL = "kvyard-sim"


# ---------------------------------------------------------------- minutes within the SLA (both replays)

def sla_minutes(reqs: list[tuple[float, float, float, int]], end_s: float, ttft_ms: float, itl_ms: float) -> list[dict]:
    """reqs: (first token s, TTFT ms, mean ITL ms, output tokens). Per minute of first tokens up to end_s (the last
    arrival; later first tokens count in the last minute): TTFT p90, token-weighted p90 of the mean ITLs, within the SLA
    or not (a minute with no request is within it)."""
    n = max(1, int(math.ceil(end_s / 60.0 - 1e-9)))
    by: list[list] = [[] for _ in range(n)]
    for first, ttft, itl, toks in reqs:
        by[min(int(first // 60.0), n - 1)].append((ttft, itl, toks))
    rows = []
    for m, rs in enumerate(by):
        t90 = float(np.percentile([r[0] for r in rs], 90)) if rs else None
        w = [(r[1], r[2] - 1) for r in rs if r[1] is not None and r[2] > 1]
        i90 = None
        if w:
            w.sort()
            cum = np.cumsum([x[1] for x in w])
            i90 = w[int(np.searchsorted(cum, 0.9 * cum[-1]))][0]
        ok = (t90 is None or t90 <= ttft_ms) and (i90 is None or i90 <= itl_ms)
        rows.append({"minute": m, "requests": len(rs), "ttft_p90_ms": None if t90 is None else round(t90, 1),
                     "itl_p90_ms": None if i90 is None else round(i90, 3), "ok": ok})
    return rows


def kvyard_reqs(r: Replay) -> list[tuple]:
    return [(x.first, x.ttft * 1000.0, None if x.tpot is None else x.tpot * 1000.0, x.tokens) for x in r.records if x.first is not None]


def dynamo_reqs(d: dict) -> list[tuple]:
    return [(p["first_token_ms"] / 1000.0, p["ttft_ms"], p["itl_ms"], p["output_length"]) for p in d["per_request"]
            if p.get("first_token_ms") is not None]


# ---------------------------------------------------------------- runs

class Bench:
    def __init__(self, args, tmp: Path) -> None:
        self.args = args
        self.npz = convert_profile(tmp)
        self.engine = EngineSpec(profile=str(self.npz), block_size=64, num_gpu_blocks=16384)
        self.dyn_engine = {**mocker_engine(self.npz, 64, 16384), "startup_time": args.startup}
        self.standins = dynamo_standins(tmp / "standins")
        self.end_s = 60.0  # the load's last arrival: every policy is judged over the same minutes (set per load)

    def cfg(self, workers: int, planner: dict | None = None) -> ReplayConfig:
        a = self.args
        return ReplayConfig(workers=workers, engine=self.engine, frontend=FrontendConfig(router={"policy": "kv"}), startup_s=a.startup,
                            slo_ttft_p90_ms=a.ttft, slo_itl_p90_ms=a.itl, planner=planner, model=MODEL)

    def summarize(self, name: str, r: Replay, reqs: list[tuple], gpu_s: float, fleet: list, t0: float, extra: dict | None = None) -> dict:
        mins = sla_minutes(reqs, self.end_s, self.args.ttft, self.args.itl)
        met = sum(m["ok"] for m in mins)
        out = {"policy": name, "minutes": len(mins), "minutes_met": met, "attainment": met / len(mins), "gpu_seconds": round(gpu_s, 1),
               "wall_s": round(time.perf_counter() - t0, 1), "per_minute": mins, "fleet": fleet}
        return {**out, **(extra or {})}

    def static(self, wl, n: int) -> tuple[Replay, list[dict]]:
        r = Replay(self.cfg(n), wl).run()
        return r, sla_minutes(kvyard_reqs(r), self.end_s, self.args.ttft, self.args.itl)

    def oracle(self, wl, need: list[int]) -> dict:
        t0 = time.perf_counter()
        ahead = max(1, int(math.ceil(self.args.startup / 60.0)))
        plan = [max(need[m: m + ahead + 1]) for m in range(len(need))]
        r = Replay(self.cfg(plan[0]), wl)
        for m, n in enumerate(plan[1:], 1):  # ready on time: started start-up seconds early, and billed for it
            r.clock.at(60.0 * m, lambda n=n: r.scale("both", n, startup_s=0.0, billed_before_s=self.args.startup), priority=1)
        r.run()
        return self.summarize("oracle", r, kvyard_reqs(r), r.gpu_seconds(), [[t, n] for t, _, n in r.fleet_log], t0,
                              {"need": need, "schedule": plan})

    def kvyard(self, wl, start: int, cap: int, setting: dict | None = None) -> dict:
        a, t0 = self.args, time.perf_counter()
        doc = {"planner": {"interval_s": a.interval, "lookahead_s": a.startup, "scale_down_cooldown_s": a.cooldown,
                           "scale_down_window_s": a.down_window, "max_step": a.max_step, "stale_after_s": 30, **(setting or {})},
               "targets": {"pools": [{"model": MODEL, "role": "both", "ttft_p90_ms": a.ttft, "itl_p90_ms": a.itl,
                                      "min_replicas": 1, "max_replicas": cap}]}}
        r = Replay(self.cfg(start, doc), wl)
        driver = PlannerDriver(r, doc)
        r.run()
        name = "kvyard planner" + ("" if not setting else " (" + ", ".join(f"{k}={v:g}" for k, v in setting.items()) + ")")
        return self.summarize(name, r, kvyard_reqs(r), r.gpu_seconds(), [[t, n] for t, _, n in r.fleet_log], t0,
                              {"planner_config": driver.cfg.model_dump(exclude={"load", "profiles"}), "setting": setting or {},
                               "decisions": driver.decisions[:300]})

    def dynamo(self, path: Path, start: int, cap: int, target: str = "throughput") -> dict:
        a, t0 = self.args, time.perf_counter()
        pc = {"mode": "agg", "backend": "mocker", "environment": "virtual", "min_endpoint": 1, "max_gpu_budget": cap,
              "ttft_ms": a.ttft, "itl_ms": a.itl, "optimization_target": target}
        d = dynamo_run(path, start, "kv_router", self.dyn_engine, per_request=True, planner_config=pc, standins=self.standins)
        reqs = dynamo_reqs(d)
        ev = d["planner"]["scaling_events"]
        fleet, n = [[0.0, start]], start
        for e in ev:
            fleet.append([e["at_s"], e["to"]])
        s = d["summary"]
        gpu = float(s.get("decode_worker_seconds") or 0.0) + float(s.get("prefill_worker_seconds") or 0.0)
        mins = sla_minutes(reqs, self.end_s, a.ttft, a.itl)
        met = sum(m["ok"] for m in mins)
        return {"policy": "dynamo planner" + ("" if target == "throughput" else f" ({target})"), "minutes": len(mins), "minutes_met": met, "attainment": met / len(mins),
                "gpu_seconds": round(gpu, 1), "wall_s": round(time.perf_counter() - t0, 1), "per_minute": mins, "fleet": fleet,
                "planner_config": pc, "dynamo_ticks": d["planner"]["total_ticks"], "completed": s["completed_requests"]}


LOAD_SLA = {"walk2": ("walk2_ttft", "walk2_itl")}  # loads judged (and planned) on their own SLA


def run_load(b: Bench, name: str, path: Path) -> dict:
    base = b.args
    if name in LOAD_SLA:
        t, i = LOAD_SLA[name]
        b.args = argparse.Namespace(**{**vars(base), "ttft": getattr(base, t), "itl": getattr(base, i)})
    try:
        return _run_load(b, name, path)
    finally:
        b.args = base


def _run_load(b: Bench, name: str, path: Path) -> dict:
    a = b.args
    wl = load_mooncake(path)
    b.end_s = wl.duration
    print(f"[{name}] {len(wl)} requests over {wl.duration / 60:.1f} min ({len(wl) / wl.duration:.1f} req/s)", flush=True)
    t0 = time.perf_counter()
    sweep: dict[int, list[bool]] = {}
    n = 1
    while n <= a.max_workers:  # fixed fleets 1, 2, ... until one meets every minute
        r, mins = b.static(wl, n)
        sweep[n] = [m["ok"] for m in mins]
        met = sum(sweep[n])
        print(f"[{name}] static {n}: {met}/{len(mins)} minutes, {r.gpu_seconds():,.0f} GPU-s ({r.wall_s:.0f} s)", flush=True)
        if met == len(mins):
            static_run = b.summarize("static at peak", r, kvyard_reqs(r), r.gpu_seconds(), [[0.0, n]], t0, {"workers": n})
            break
        n += 1
    else:
        raise SystemExit(f"{name}: no fixed fleet up to {a.max_workers} meets every minute; raise --max-workers")
    peak = n
    minutes = len(sweep[peak])
    need = [next((k for k in sorted(sweep) if k <= peak and len(sweep[k]) > m and sweep[k][m]), peak) for m in range(minutes)]
    results = {"static at peak": static_run}
    results["oracle"] = b.oracle(wl, need)
    cap = 2 * peak
    results["kvyard planner"] = b.kvyard(wl, need[0], cap)
    for setting in sweep_settings(a.sweep):  # the same planner at other settings: its cost/SLA trade-off
        res = b.kvyard(wl, need[0], cap, setting)
        results[res["policy"]] = res
    results["dynamo planner"] = b.dynamo(path, need[0], cap)
    for target in filter(None, a.dynamo_variants.split(",")):
        results[f"dynamo planner ({target})"] = b.dynamo(path, need[0], cap, target)
    for k, res in results.items():
        print(f"[{name}] {k:15s} {res['minutes_met']}/{res['minutes']} minutes, {res['gpu_seconds']:,.0f} GPU-s", flush=True)
    return {"requests": len(wl), "duration_min": round(wl.duration / 60, 1), "static_sweep": {str(k): v for k, v in sweep.items()},
            "sla": {"ttft_ms": a.ttft, "itl_ms": a.itl}, "policies": results}


def sweep_settings(spec: str) -> list[dict]:
    """'demand_z=0,0.64,2.5' -> [{'demand_z': 0.0}, ...]"""
    if not spec:
        return []
    key, vals = spec.split("=", 1)
    return [{key: float(v)} for v in vals.split(",") if v]


def loads(args, tmp: Path) -> dict[str, Path]:
    out = {}
    for name in filter(None, args.loads.split(",")):
        if name == "mooncake":
            wl = load_mooncake(TRACE, time_scale=args.mooncake_scale)
        elif name == "daily":
            wl = synthetic(f"daily:minutes={args.daily_minutes},peak={args.daily_peak},trough={args.daily_trough},bodies={TRACE}",
                           seed=args.seed)
        elif name == "walk":
            wl = synthetic(f"walk:minutes={args.walk_minutes},start={args.walk_start},lo={args.walk_lo},hi={args.walk_hi},"
                           f"step_s=120,sigma=0.25,spikes=2,spike_factor=2,bodies={TRACE}", seed=args.seed)
        elif name == "walk2":
            wl = synthetic(f"walk:minutes={args.walk2_minutes},start=5,lo=2,hi=9,step_s=60,sigma=0.35,spikes=3,spike_factor=1.5,"
                           f"bodies={TRACE}", seed=args.walk2_seed)
        else:
            raise SystemExit(f"unknown load {name!r}")
        out[name] = wl.write_mooncake(tmp / f"{name}.jsonl")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks planner", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", default="mooncake,daily,walk,walk2")
    ap.add_argument("--mooncake-scale", type=float, default=4.0)
    ap.add_argument("--daily-minutes", type=float, default=40.0)
    ap.add_argument("--daily-peak", type=float, default=12.0)
    ap.add_argument("--daily-trough", type=float, default=3.0)
    ap.add_argument("--walk-minutes", type=float, default=40.0)
    ap.add_argument("--walk-start", type=float, default=6.0)
    ap.add_argument("--walk-lo", type=float, default=2.0)
    ap.add_argument("--walk-hi", type=float, default=12.0)
    ap.add_argument("--walk2-minutes", type=float, default=30.0)
    ap.add_argument("--walk2-seed", type=int, default=2027)
    ap.add_argument("--walk2-ttft", type=float, default=1000.0, help="walk2's TTFT p90 target per minute, ms")
    ap.add_argument("--walk2-itl", type=float, default=30.0, help="walk2's ITL p90 target per minute, ms")
    ap.add_argument("--sweep", default="demand_z=0,0.64,2.5",
                    help="kvyard's planner also at these settings (KEY=v1,v2,...): its cost/SLA trade-off beside Dynamo's points")
    ap.add_argument("--merge", default="", help="only merge results/<a>.json,<b>.json,... (runs of disjoint --loads) into --out")
    ap.add_argument("--ttft", type=float, default=1500.0, help="TTFT p90 target per minute, ms")
    ap.add_argument("--itl", type=float, default=25.0, help="ITL p90 target per minute, ms")
    ap.add_argument("--startup", type=float, default=60.0, help="worker start-up, s")
    ap.add_argument("--interval", type=float, default=15.0, help="kvyard planner tick, s")
    ap.add_argument("--cooldown", type=float, default=60.0)
    ap.add_argument("--down-window", type=float, default=120.0)
    ap.add_argument("--max-step", type=int, default=8)
    ap.add_argument("--max-workers", type=int, default=40)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--dynamo-variants", default="latency", help="Dynamo optimization targets run beside its default (throughput)")
    ap.add_argument("--add-dynamo-variants", action="store_true",
                    help="only run --dynamo-variants on the loads of an existing results/<out>.json (same seeds and starts) and merge")
    ap.add_argument("--out", default="planner_sim")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args)
    tmp = Path(tempfile.mkdtemp(prefix="kvyard-planner-bench-"))
    b = Bench(args, tmp)
    if args.add_dynamo_variants:
        return add_variants(b, args, tmp)
    report = {"machine": machine(), "command": "python -m benchmarks planner " + " ".join(argv if argv is not None else sys.argv[1:]),
              "config": vars(args), "loads": {}}
    for name, path in loads(args, tmp).items():
        report["loads"][name] = run_load(b, name, path)
        write(report, args)
    return 0


def add_variants(b: Bench, args, tmp: Path) -> int:
    """Dynamo planner variants run after the fact on the same loads, starts and caps, merged into the report."""
    path = RESULTS / f"{args.out}.json"
    report = json.loads(path.read_text())
    files = loads(argparse.Namespace(**{**report["config"], "loads": ",".join(report["loads"])}), tmp)
    for name, d in report["loads"].items():
        wl = load_mooncake(files[name])
        b.end_s = wl.duration
        start = d["policies"]["oracle"]["schedule"][0]
        cap = 2 * d["policies"]["static at peak"]["workers"]
        for target in filter(None, args.dynamo_variants.split(",")):
            r = b.dynamo(files[name], start, cap, target)
            d["policies"][r["policy"]] = r
            print(f"[{name}] {r['policy']}: {r['minutes_met']}/{r['minutes']} minutes, {r['gpu_seconds']:,.0f} GPU-s", flush=True)
    report["command_variants"] = "python -m benchmarks planner --add-dynamo-variants --dynamo-variants " + args.dynamo_variants
    write(report, argparse.Namespace(**report["config"]))
    return 0


def merge(args) -> int:
    """Runs of disjoint loads (e.g. two processes on two cores) as one report."""
    parts = [json.loads((RESULTS / f"{n}.json").read_text()) for n in args.merge.split(",")]
    report = {**parts[0], "loads": {}, "command": " && ".join(p["command"] for p in parts) + f" && python -m benchmarks planner --merge {args.merge} --out {args.out}"}
    report["machines"] = [p["machine"] for p in parts]
    for p in parts:
        report["loads"].update(p["loads"])
    cfg = {**parts[0]["config"], "out": args.out, "loads": ",".join(report["loads"])}
    report["config"] = cfg
    write(report, argparse.Namespace(**cfg))
    for n in args.merge.split(","):
        if n != args.out:
            for f in RESULTS.glob(f"{n}.*"):
                f.unlink()
            for f in RESULTS.glob(f"{n}_*.png"):
                f.unlink()
    return 0


def write(report: dict, args) -> None:
    from benchmarks.planner_report import write_report

    write_report(report, args, RESULTS)


if __name__ == "__main__":
    raise SystemExit(main())
