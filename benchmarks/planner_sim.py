"""Planner benchmark (offline, virtual clock): SLA attainment and GPU-seconds of four ways to size a
disaggregated Llama-3.1-8B-FP8 deployment on H200 (the bundled profile), on two time-varying loads.

    python -m benchmarks.planner_sim [--workload daily|mooncake|all] [--minutes 240] [--out benchmarks/results]

Loads (request bodies — ISL, OSL, and the prefix hits their hash_ids give in a 512-token-block LRU
of --cache-blocks — are the Mooncake conversation trace's):
    daily     a compressed day of `--minutes`: rate(t) = trough + (peak − trough)·(1 − cos 2πt/T)/2,
              Poisson arrivals, plus 3 bursts of ×1.6 for 3 min each at random times (seeded);
              bodies drawn at random from the trace, prefix hits as in a warm replay of it
    mooncake  the trace's own arrival times divided by `--mooncake-speed` (5: ~17 req/s for ~12 min)
Policies: planner (kvyard), static at the oracle's peak, keda (queue threshold 5), oracle (see
planner_policies.py), and late-oracle:h (the oracle's per-minute counts one minute late, × headroom h,
ready at once: more than a reactive planner knows, a reference for what reacting can reach, not a proof).
SLA: a minute meets it when its TTFT p90 <= --ttft and its token-weighted ITL p90 <= --itl. Output: results/planner_sim.json and results/planner_sim_<workload>.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path

import numpy as np

from benchmarks.planner_model import DisaggSim, Requests, SimConfig, cached_tokens
from benchmarks.planner_policies import KedaPolicy, PlannerPolicy, oracle_minute
from planner.config import PlannerConfig
from planner.perf_model import load_perf_model
from planner.predictors import PREDICTORS

HERE = Path(__file__).resolve().parent
TRACE = HERE / "data" / "mooncake_conversation_trace.jsonl"


# planner variants run beside the default one (--variants): what each changes in the PlannerConfig
VARIANTS: dict[str, dict] = {
    "before": {"predictor": "kalman", "net_of_sampling_noise": False, "hybrid_prefill_queue": True},  # the earlier defaults
    "kalman": {"predictor": "kalman"},
    "peak_trend": {"predictor": "peak_trend"},
    "prefill_queue": {"hybrid_prefill_queue": True},
    "peak_trend+prefill_queue": {"predictor": "peak_trend", "hybrid_prefill_queue": True},
    "net_noise": {"net_of_sampling_noise": True},
    "peak_trend+net_noise": {"predictor": "peak_trend", "net_of_sampling_noise": True},
    "sla": {"mode": "sla"},
}


def load_trace(path: Path = TRACE) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _bodies(rows: list[dict], cache_blocks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ISL, OSL and prefix-hit tokens of the trace's requests, in trace order."""
    isl = np.array([r["input_length"] for r in rows], dtype=float)
    osl = np.array([max(r["output_length"], 1) for r in rows], dtype=float)
    return isl, osl, cached_tokens(isl.astype(int).tolist(), [r["hash_ids"] for r in rows], cache_blocks)


def _warm_bodies(rows: list[dict], cache_blocks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Like _bodies, but each request's prefix hit is taken from a second replay of the trace behind
    the first (a warm cache), so no request carries the recording's cold start."""
    isl, osl, cached = _bodies(rows + rows, cache_blocks)
    n = len(rows)
    return isl[n:], osl[n:], cached[n:]


def daily_load(rows: list[dict], minutes: float, peak: float, trough: float, seed: int, cache_blocks: int) -> Requests:
    rng = np.random.default_rng(seed)
    T = minutes * 60.0
    bursts = sorted(rng.uniform(0.1 * T, 0.9 * T, size=3))

    def rate(t: np.ndarray) -> np.ndarray:
        r = trough + (peak - trough) * (1 - np.cos(2 * np.pi * t / T)) / 2
        for b in bursts:
            r = np.where((t >= b) & (t < b + 180.0), r * 1.6, r)
        return r

    top = peak * 1.6
    t, out = 0.0, []
    while t < T:  # thinning of a Poisson process at rate `top`
        t += rng.exponential(1.0 / top)
        if t < T and rng.uniform() < rate(np.array([t]))[0] / top:
            out.append(t)
    isl, osl, cached = _warm_bodies(rows, cache_blocks)
    pick = rng.integers(0, len(rows), size=len(out))  # bodies drawn at random: no lap of the trace repeats
    return Requests(np.array(out), isl[pick], osl[pick], cached[pick])


def mooncake_load(rows: list[dict], speed: float, cache_blocks: int) -> Requests:
    t = np.array([r["timestamp"] for r in rows], dtype=float) / 1000.0 / speed
    isl, osl, cached = _bodies(rows, cache_blocks)
    order = np.argsort(t, kind="stable")
    return Requests(t[order], isl[order], osl[order], cached[order])


async def run_policy(name: str, reqs: Requests, perf, args, schedule: list[tuple[int, int]] | None = None,
                     start: tuple[int, int] = (1, 1)) -> dict:
    cfg = SimConfig(slice_s=args.slice, startup_s=args.startup)
    sim = DisaggSim(perf, reqs, cfg, *start)
    end = float(reqs.t[-1]) + 1.0
    minutes = int(math.ceil(end / 60.0))
    per_min = int(round(60.0 / cfg.slice_s))
    policy = None
    if name.startswith("planner"):
        pcfg = PlannerConfig(predictor=args.predictor, interval_s=args.interval, window_s=args.window, lookahead_s=args.startup,
                             scale_down_cooldown_s=args.cooldown, scale_down_window_s=args.down_window, stale_after_s=30, max_step=args.max_step,
                             demand_z=args.demand_z, max_headroom=args.max_headroom, mode=args.mode, peak_window=args.peak_window,
                             net_of_sampling_noise=args.net_headroom, hybrid_prefill_queue=args.hybrid_prefill_queue)
        if ":" in name:  # a variant: the same run with some planner settings changed
            pcfg = pcfg.model_copy(update=VARIANTS[name.split(":", 1)[1]])
        targets = {"pools": [{"model": "llama-3.1-8b", "role": role, "ttft_p90_ms": args.ttft, "itl_p90_ms": args.itl,
                              "min_replicas": 1, "max_replicas": args.pmax} for role in ("prefill", "decode")]}
        policy = PlannerPolicy(sim, perf, pcfg, targets)
        await policy.setup()
    elif name == "keda":
        policy = KedaPolicy(sim, max_replicas=args.pmax)
        sim.events = None
    else:
        sim.events = None
    chosen, t0 = [], time.perf_counter()
    for m in range(minutes):
        if name == "oracle-search":
            p, d = oracle_minute(sim, per_min, args.ttft, args.itl, args.pmax, args.dmax, sim.replicas())
            sim.scale(p, d, startup_s=0.0)
        elif name == "oracle" and schedule:
            # pass 2: keep a replica through a dip no longer than its start-up (as cheap as restarting it)
            ahead = max(1, int(math.ceil(args.startup / 60.0)))
            p = max(s[0] for s in schedule[m: m + ahead + 1])
            d = max(s[1] for s in schedule[m: m + ahead + 1])
            before = sim.replicas()
            sim.scale(p, d, startup_s=0.0)
            sim.gpu_s += args.startup * (max(0, p - before[0]) + max(0, d - before[1]))  # started early, billed
        elif name.startswith("late-oracle") and schedule:
            # the oracle's own counts one minute late, times a headroom: a generous reference for reacting
            h = float(name.split(":", 1)[1]) if ":" in name else 1.0
            prev = schedule[max(0, m - 1)]
            p, d = (min(cap, math.ceil(h * n - 1e-9)) for n, cap in zip(prev, (args.pmax, args.dmax)))
            before = sim.replicas()
            sim.scale(p, d, startup_s=0.0)
            sim.gpu_s += args.startup * (max(0, p - before[0]) + max(0, d - before[1]))  # ready at once, start-up billed
        elif name == "static" and schedule:
            sim.scale(*schedule[0], startup_s=0.0)
        for _ in range(per_min):
            if policy is not None:
                await policy.before_step()
            sim.step()
        chosen.append(sim.replicas())
    rows = []
    for m in range(minutes):
        ok, t90, i90 = sim.minute_ok(m, args.ttft, args.itl)
        rows.append({"minute": m, "ok": ok, "ttft_p90_ms": t90, "itl_p90_ms": i90, "prefill": chosen[m][0], "decode": chosen[m][1]})
    met = sum(r["ok"] for r in rows)
    out = {"policy": name, "minutes": minutes, "minutes_met": met, "attainment": met / minutes, "gpu_seconds": sim.gpu_s,
           "requests": len(reqs), "wall_s": round(time.perf_counter() - t0, 1), "per_minute": rows}
    if name.startswith("planner"):
        out["planner_config"] = pcfg.model_dump(exclude={"load", "profiles"})
        out["decisions"] = [d for d in await policy.store.recent_decisions(1000) if any(p["changed"] for p in d["pools"])][::-1][:400]
    return out


def plot(workload: str, results: dict[str, dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True)
    for name, res in results.items():
        if ":" in name:  # variants are in the JSON and the report, not the plot
            continue
        mins = [r["minute"] for r in res["per_minute"]]
        axes[0].step(mins, [r["prefill"] for r in res["per_minute"]], where="post", label=name)
        axes[1].step(mins, [r["decode"] for r in res["per_minute"]], where="post", label=name)
        axes[2].plot(mins, [r["ttft_p90_ms"] or np.nan for r in res["per_minute"]], label=name, lw=1)
        axes[3].plot(mins, [r["itl_p90_ms"] or np.nan for r in res["per_minute"]], label=name, lw=1)
    axes[2].axhline(args.ttft, color="k", ls="--", lw=0.8)
    axes[3].axhline(args.itl, color="k", ls="--", lw=0.8)
    axes[2].set_yscale("log")
    for ax, lab in zip(axes, ["prefill replicas", "decode replicas", "TTFT p90 (ms)", "ITL p90 (ms)"]):
        ax.set_ylabel(lab)
        ax.grid(alpha=0.3)
    axes[0].legend(ncol=4, fontsize=8)
    axes[-1].set_xlabel("minute")
    summary = ", ".join(f"{n}: {r['attainment']:.1%} / {r['gpu_seconds'] / 3600:.1f} GPU-h" for n, r in results.items() if ":" not in n)
    fig.suptitle(f"planner benchmark — {workload}\n{summary}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def bench(workload: str, rows: list[dict], perf, args) -> dict:
    cache_blocks = args.cache_blocks
    reqs = daily_load(rows, args.minutes, args.peak, args.trough, args.seed, cache_blocks) if workload == "daily" \
        else mooncake_load(rows, args.mooncake_speed, cache_blocks)
    print(f"[{workload}] {len(reqs)} requests over {reqs.t[-1] / 60:.1f} min, mean {len(reqs) / reqs.t[-1]:.1f} req/s, "
          f"prefix hit {reqs.cached.sum() / reqs.isl.sum():.1%}", flush=True)
    results: dict[str, dict] = {}
    if args.only:
        for name in args.only.split(","):
            start = tuple(args.start) if args.start else (1, 1)
            results[name] = r = await run_policy(name, reqs, perf, args, start=start)
            print(f"[{workload}] {name:8s} attainment {r['attainment']:6.1%} ({r['minutes_met']}/{r['minutes']} min)  "
                  f"GPU-s {r['gpu_seconds']:9.0f}  ({r['wall_s']} s)", flush=True)
        return {"requests": len(reqs), "policies": results}
    need = await run_policy("oracle-search", reqs, perf, args)  # pass 1: the smallest counts, minute by minute
    schedule = [(r["prefill"], r["decode"]) for r in need["per_minute"]]
    results["oracle"] = await run_policy("oracle", reqs, perf, args, schedule=schedule, start=schedule[0])
    results["oracle"]["search_wall_s"] = need["wall_s"]
    results["oracle"]["need"] = schedule  # pass 1's counts per minute (before the keep-through-a-dip pass)
    first = (results["oracle"]["per_minute"][0]["prefill"], results["oracle"]["per_minute"][0]["decode"])
    peak = (max(r["prefill"] for r in results["oracle"]["per_minute"]), max(r["decode"] for r in results["oracle"]["per_minute"]))
    results["static"] = await run_policy("static", reqs, perf, args, schedule=[peak], start=peak)
    for h in filter(None, args.late_oracle.split(",")):
        results[f"late-oracle:{float(h):g}"] = await run_policy(f"late-oracle:{float(h):g}", reqs, perf, args,
                                                               schedule=schedule, start=schedule[0])
    results["keda"] = await run_policy("keda", reqs, perf, args, start=first)
    results["planner"] = await run_policy("planner", reqs, perf, args, start=first)
    for v in filter(None, args.variants.split(",")):
        results[f"planner:{v}"] = await run_policy(f"planner:{v}", reqs, perf, args, start=first)
    oracle_gpu = results["oracle"]["gpu_seconds"]
    for name, r in results.items():
        r["gpu_vs_oracle"] = r["gpu_seconds"] / oracle_gpu
        print(f"[{workload}] {name:8s} attainment {r['attainment']:6.1%} ({r['minutes_met']}/{r['minutes']} min)  "
              f"GPU-s {r['gpu_seconds']:9.0f}  ×oracle {r['gpu_vs_oracle']:.3f}  ({r['wall_s']} s)", flush=True)
    plot(workload, results, args, Path(args.out) / f"planner_sim_{workload}.png")
    return {"requests": len(reqs), "duration_min": float(reqs.t[-1] / 60), "static_peak": peak, "policies": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="all", choices=["daily", "mooncake", "all"])
    ap.add_argument("--minutes", type=float, default=240.0, help="daily: length of the compressed day")
    ap.add_argument("--peak", type=float, default=40.0, help="daily: req/s at the top of the curve (bursts ×1.6)")
    ap.add_argument("--trough", type=float, default=8.0)
    ap.add_argument("--mooncake-speed", type=float, default=5.0)
    ap.add_argument("--profile", default="h200-llama3.1-8b")
    ap.add_argument("--ttft", type=float, default=1000.0, help="TTFT p90 target, ms")
    ap.add_argument("--itl", type=float, default=25.0, help="ITL p90 target, ms")
    ap.add_argument("--startup", type=float, default=60.0, help="replica start-up time, s")
    ap.add_argument("--slice", type=float, default=0.25)
    ap.add_argument("--interval", type=float, default=15.0, help="planner tick, s")
    ap.add_argument("--window", type=float, default=None, help="planner telemetry window, s (default: the tick)")
    ap.add_argument("--cooldown", type=float, default=60.0, help="planner scale-down cooldown, s")
    ap.add_argument("--down-window", type=float, default=120.0, help="planner scale-down stabilization window, s")
    ap.add_argument("--max-step", type=int, default=8)
    ap.add_argument("--predictor", default="peak_trend", choices=list(PREDICTORS))
    ap.add_argument("--peak-window", type=int, default=2, help="peak_trend: ticks whose highest rate floors the forecast")
    ap.add_argument("--hybrid-prefill-queue", action="store_true", help="hybrid: a prefill queue adds load corrections "
                                                                        "(before: yes; now only TTFT p90 over target does)")
    ap.add_argument("--net-headroom", action="store_true", help="headroom from the forecast error net of sampling noise")
    ap.add_argument("--mode", default="hybrid", choices=["sla", "load", "hybrid"])
    ap.add_argument("--demand-z", type=float, default=1.28)
    ap.add_argument("--max-headroom", type=float, default=1.5)
    ap.add_argument("--cache-blocks", type=int, default=8 * 1845, help="prefix-cache LRU, 512-token blocks")
    ap.add_argument("--pmax", type=int, default=32)
    ap.add_argument("--dmax", type=int, default=32)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--variants", default="before,kalman,peak_trend+prefill_queue", help=f"comma-separated planner variants run beside it: {', '.join(VARIANTS)}")
    ap.add_argument("--late-oracle", default="1,1.15,1.3,1.6",
                    help="headrooms h: also run the oracle's per-minute counts one minute late × h (ready at once, "
                         "start-up billed): a generous reference for a planner that only reacts; empty to skip")
    ap.add_argument("--only", default="", help="comma-separated policies to run alone (tuning; no oracle, no plot)")
    ap.add_argument("--start", type=int, nargs=2, default=None, help="with --only: initial prefill decode replicas")
    args = ap.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    perf = load_perf_model(args.profile)
    rows = load_trace()
    workloads = ["daily", "mooncake"] if args.workload == "all" else [args.workload]
    report = {"config": vars(args), "workloads": {}}
    for w in workloads:
        report["workloads"][w] = asyncio.run(bench(w, rows, perf, args))
    path = Path(args.out) / ("planner_sim.json" if args.workload == "all" else f"planner_sim_{args.workload}.json")
    path.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
