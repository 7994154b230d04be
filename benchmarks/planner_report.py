"""The planner benchmark's report (benchmarks/planner_sim.py): JSON, a Markdown table per load, a PNG per load."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["write_report"]

ORDER = ("kvyard planner", "dynamo planner", "dynamo planner (latency)", "dynamo planner (load)", "static at peak", "oracle")


def write_report(report: dict, args, results: Path) -> None:
    results.mkdir(exist_ok=True)
    out = args.out
    (results / f"{out}.json").write_text(json.dumps(report, indent=1, default=str))
    m = report["machine"]
    L = ["# Planner benchmark on kvyard replay: kvyard's planner, Dynamo's planner, static at peak, the oracle", "",
         f"Run {m['when']} on {m['cpus']} shared CPUs (load average {m['loadavg']} at start); `benchmarks/planner_sim.py` "
         "says how each policy runs. Engines on the mocker's terms in both replays (H200 profile through Dynamo's converter; "
         f"block size 64, 16,384 KV blocks per worker); start-up {args.startup:g} s, billed from the scale-up request; removed "
         f"workers drain. A minute is within the SLA when its TTFT p90 <= {args.ttft:g} ms and its token-weighted ITL p90 <= "
         f"{args.itl:g} ms (per-request records of both replays, the same function). Dynamo's planner runs in Dynamo's own "
         "replay in its load-based modes (optimization_target throughput, its default, and latency); its SLA mode needs "
         "AISimulate, which does not install here.", "", "```", report["command"], "```", ""]
    if report.get("command_variants"):
        L += ["Dynamo variants added after the run on the same loads and starts:", "", "```", report["command_variants"], "```", ""]
    L += [
         "| load | policy | minutes within SLA | GPU-seconds | × oracle | × Dynamo's GPU-s |", "|---|---|---:|---:|---:|---:|"]
    verdicts = []
    for load, d in report["loads"].items():
        pol = d["policies"]
        oracle = pol["oracle"]["gpu_seconds"]
        dyn = pol.get("dynamo planner")
        first = True
        for name in ORDER:
            r = pol.get(name)
            if r is None:
                continue
            label = f"{load} ({d['requests']:,} requests, {d['duration_min']} min)" if first else ""
            first = False
            extra = f" ({r['workers']} workers)" if name == "static at peak" else ""
            xd = f"{r['gpu_seconds'] / dyn['gpu_seconds']:.3f}" if dyn and dyn["gpu_seconds"] else "-"
            L.append(f"| {label} | {name}{extra} | {r['minutes_met']}/{r['minutes']} ({r['attainment']:.1%}) | {r['gpu_seconds']:,.0f} | "
                     f"{r['gpu_seconds'] / oracle:.3f} | {xd} |")
        k = pol.get("kvyard planner")
        for dname in [n for n in ORDER if n.startswith("dynamo") and n in pol]:
            dv = pol[dname]
            if not k or not dv["gpu_seconds"]:
                continue
            ok = k["minutes_met"] >= dv["minutes_met"] and k["gpu_seconds"] <= 0.9 * dv["gpu_seconds"]
            verdicts.append(f"- {load}, against {dname}: kvyard {k['minutes_met']} vs Dynamo {dv['minutes_met']} minutes within SLA, "
                            f"GPU-seconds {k['gpu_seconds'] / dv['gpu_seconds']:.3f}× Dynamo's → target (≥ its minutes at ≤ 0.9× its "
                            f"GPU-s) {'**met**' if ok else '**not met**'}")
    L += ["", "Target: at least Dynamo's minutes within SLA at ≤ 0.9× its GPU-seconds.", ""] + verdicts + [""]
    (results / f"{out}.md").write_text("\n".join(L))
    print("\n".join(L))
    for load, d in report["loads"].items():
        plot(load, d, args, results / f"{out}_{load}.png")


def plot(load: str, d: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    for name in ORDER:
        r = d["policies"].get(name)
        if r is None:
            continue
        pts = r["fleet"]
        end = d["duration_min"]
        xs = [p[0] / 60.0 for p in pts] + [end]
        ys = [p[-1] for p in pts] + [pts[-1][-1]]
        axes[0].step(xs, ys, where="post", label=f"{name}: {r['minutes_met']}/{r['minutes']} min, {r['gpu_seconds']:,.0f} GPU-s")
        mins = r["per_minute"]
        axes[1].plot([x["minute"] for x in mins], [x["ttft_p90_ms"] or float("nan") for x in mins], lw=1, label=name)
        axes[2].plot([x["minute"] for x in mins], [x["itl_p90_ms"] or float("nan") for x in mins], lw=1, label=name)
    axes[1].axhline(args.ttft, color="k", ls="--", lw=0.8)
    axes[2].axhline(args.itl, color="k", ls="--", lw=0.8)
    axes[1].set_yscale("log")
    for ax, lab in zip(axes, ["workers (starting + ready)", "TTFT p90 per minute (ms)", "ITL p90 per minute (ms)"]):
        ax.set_ylabel(lab)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[2].set_xlabel("minute")
    fig.suptitle(f"planner benchmark — {load}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
