"""Routing at fleet scale, kvyard beside Dynamo, each in its own replay on the same engines (`benchmarks/replay_compare.py
routing`; see that file for how the engines are put on the mocker's terms).

Per fleet size N (default 8, 32, 128): the whole conversation trace with its times divided by a scale s_N chosen so
that round-robin's TTFT p90 is at least 3x its unloaded value. Unloaded = the same trace at 1/50 of its own rate through
round-robin on 8 workers (no queueing; prefix hits as they come). s_N is the first of --scale-candidates × N/8 (per-worker
load held; a larger fleet starts at the factor the smaller one needed) that reaches 3x in kvyard's round-robin, unless
--scales gives it. Then four replays on the same file:
kvyard kv (the frontend's defaults) and round-robin, Dynamo kv_router (its defaults: overlap weight 1, temperature 0,
KV events) and round_robin. Reported: TTFT p50/p90/p99, ITL p50, prefix-cache hit rate (reused prompt tokens / prompt
tokens) and kvyard's share of the fleet bound; targets: kvyard kv TTFT p90 <= 0.9x Dynamo kv_router's, hits >= Dynamo's.
Writes benchmarks/results/replay_routing.{json,md,png}.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from benchmarks.dynamo_compare import convert_profile
from benchmarks.replay_compare import (RESULTS, TRACE, dynamo_row, dynamo_run, kvyard_row, kvyard_run, machine, mocker_engine,
                                       ratio)
from orchestrator.replay import EngineSpec, load_mooncake
from orchestrator.replay.bound import fleet_bound

__all__ = ["add_args", "run"]


def add_args(ap) -> None:
    ap.add_argument("--fleets", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--num-gpu-blocks", type=int, default=16384)
    ap.add_argument("--scales", default="", help="N:s,... time scales per fleet size (skips the search)")
    ap.add_argument("--scale-candidates", type=float, nargs="+", default=[1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
                    help="times N/8: the search's time scales")
    ap.add_argument("--out", default="replay_routing")


def run(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvyard-replay-routing-"))
    npz = convert_profile(tmp)
    engine = EngineSpec(profile=str(npz), block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks)
    dyn_engine = mocker_engine(npz, args.block_size, args.num_gpu_blocks)
    fixed = {int(k): float(v) for k, v in (x.split(":") for x in filter(None, args.scales.split(",")))}
    light = kvyard_row(kvyard_run(load_mooncake(TRACE, time_scale=1 / 50), 8, "round-robin", engine))
    unloaded = light["ttft_p90"]
    print(f"[routing] unloaded TTFT p90 {unloaded} ms (p50 {light['ttft_p50']})", flush=True)
    out = {"machine": machine(), "block_size": args.block_size, "num_gpu_blocks": args.num_gpu_blocks, "unloaded": light,
           "command": "benchmarks/replay_compare.py " + " ".join(sys.argv[1:]), "fleets": []}
    floor = 0.0  # per-worker load factor that reached 3x on the previous fleet: larger fleets start there
    for n in args.fleets:
        tried = []
        if n in fixed:
            scale = fixed[n]
            rr = kvyard_row(kvyard_run(load_mooncake(TRACE, time_scale=scale), n, "round-robin", engine))
        else:
            for c in [c for c in args.scale_candidates if c >= floor] or args.scale_candidates[-1:]:
                scale = c * n / 8
                rr = kvyard_row(kvyard_run(load_mooncake(TRACE, time_scale=scale), n, "round-robin", engine))
                tried.append({"scale": scale, "rr_ttft_p90": rr["ttft_p90"]})
                print(f"[routing] N={n} scale {scale:g}: round-robin TTFT p90 {rr['ttft_p90']} ms "
                      f"({rr['ttft_p90'] / unloaded:.2f}x unloaded)", flush=True)
                if rr["ttft_p90"] >= 3 * unloaded:
                    floor = c
                    break
        wl = load_mooncake(TRACE, time_scale=scale)
        bound = fleet_bound(wl, args.block_size, n * (args.num_gpu_blocks - 1))
        kv_res = kvyard_run(wl, n, "kv", engine, bound=bound)
        kv = kvyard_row(kv_res)
        rr["share_of_bound"] = round(rr["hit_rate"] / bound["hit_rate"], 4) if bound else None
        dkv = dynamo_row(dynamo_run(TRACE, n, "kv_router", dyn_engine, scale))
        drr = dynamo_row(dynamo_run(TRACE, n, "round_robin", dyn_engine, scale))
        row = {"workers": n, "time_scale": scale, "rate": round(len(wl) / wl.duration, 2), "scale_search": tried,
               "rr_over_unloaded": round(rr["ttft_p90"] / unloaded, 3), "dynamo_rr_over_unloaded": round(drr["ttft_p90"] / unloaded, 3),
               "fleet_bound_hit_rate": bound["hit_rate"] if bound else None,
               "kvyard": {"kv": kv, "round-robin": rr}, "dynamo": {"kv_router": dkv, "round_robin": drr},
               "kv_p90_over_dynamo_kv": ratio(kv["ttft_p90"], dkv["ttft_p90"]),
               "kv_hits_minus_dynamo_pt": round(100 * (kv["hit_rate"] - dkv["hit_rate"]), 2)}
        out["fleets"].append(row)
        print(f"[routing] N={n}: {json.dumps(row)}", flush=True)
    write(out, args.out)
    return out


def _fmt(x, nd: int = 1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def write(out: dict, name: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1))
    m = out["machine"]
    L = ["# Routing at fleet scale: kvyard replay beside Dynamo 1.6.1's replay", "",
         f"Run {m['when']} on {m['cpus']} shared CPUs (load average {m['loadavg']} at start). The whole Mooncake conversation "
         f"trace (12,031 requests) per fleet size; engines on the mocker's terms in both replays (H200 profile through Dynamo's "
         f"converter, mocker step timing), block size {out['block_size']}, {out['num_gpu_blocks']} KV blocks per worker. "
         f"Unloaded TTFT p90 (the trace at 1/50 of its rate, round-robin, 8 workers): {out['unloaded']['ttft_p90']:.1f} ms.", "",
         "```", out["command"], "```", "",
         "| workers | trace rate ×, req/s | router | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | hit rate | % of fleet bound | wall s |",
         "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for f in out["fleets"]:
        lab = f"×{f['time_scale']:g}, {f['rate']}"
        for who, router, r in (("kvyard", "kv", f["kvyard"]["kv"]), ("kvyard", "round-robin", f["kvyard"]["round-robin"]),
                               ("Dynamo", "kv_router", f["dynamo"]["kv_router"]), ("Dynamo", "round_robin", f["dynamo"]["round_robin"])):
            share = r.get("share_of_bound")
            if share is None and f["fleet_bound_hit_rate"]:
                share = r["hit_rate"] / f["fleet_bound_hit_rate"]
            L.append(f"| {f['workers']} | {lab} | {who} {router} | {_fmt(r['ttft_p50'])} | {_fmt(r['ttft_p90'])} | {_fmt(r['ttft_p99'])} | "
                     f"{_fmt(r['itl_p50'], 2)} | {r['hit_rate']:.2%} | {'-' if share is None else f'{share:.1%}'} | {_fmt(r['wall_s'])} |")
    L += ["", "| workers | round-robin p90 / unloaded (kvyard, Dynamo) | kvyard kv p90 / Dynamo kv_router p90 (target <= 0.9) | "
              "hits kvyard kv − Dynamo kv_router (target >= 0) |", "|---:|---|---:|---:|"]
    for f in out["fleets"]:
        L.append(f"| {f['workers']} | {f['rr_over_unloaded']:.2f}×, {f['dynamo_rr_over_unloaded']:.2f}× | "
                 f"**{f['kv_p90_over_dynamo_kv']:.3f}** | **{f['kv_hits_minus_dynamo_pt']:+.2f} pt** |")
    (RESULTS / f"{name}.md").write_text("\n".join(L) + "\n")
    print("\n".join(L))
    plot(out, RESULTS / f"{name}.png")


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    names = [("kvyard", "kv"), ("kvyard", "round-robin"), ("dynamo", "kv_router"), ("dynamo", "round_robin")]
    xs = [f["workers"] for f in out["fleets"]]
    for who, name in names:
        axes[0].plot(xs, [f[who][name]["ttft_p90"] for f in out["fleets"]], marker="o", label=f"{who} {name}")
        axes[1].plot(xs, [100 * f[who][name]["hit_rate"] for f in out["fleets"]], marker="o", label=f"{who} {name}")
    axes[1].plot(xs, [100 * (f["fleet_bound_hit_rate"] or 0) for f in out["fleets"]], "k--", label="fleet bound")
    for ax, lab in zip(axes, ["TTFT p90 (ms)", "prefix-cache hit rate (%)"]):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("workers (trace rate scaled with the fleet)")
        ax.set_ylabel(lab)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
