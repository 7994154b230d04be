"""A finished replay as a result dict (the JSON), a summary table and PNG plots.

Hit rate: every engine's prefix-cache hit tokens over its queried prompt tokens (the pool that prefills: both, or
prefill in P/D), and that rate as a share of the fleet bound's (orchestrator/replay/bound.py).
GPU-seconds: each worker from its scale-up request until it is drained (or the run ends), × GPUs per replica.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from orchestrator.replay.bound import fleet_bound
from orchestrator.replay.results import summarize
from orchestrator.replay.runner import Replay

__all__ = ["plot", "result_of", "summary_table"]


def result_of(replay: Replay, label: str, bound: dict | None | bool = True) -> dict:
    """The run's result dict; `bound` True computes the fleet bound here (pass a dict to reuse one, False to skip)."""
    cfg = replay.cfg
    s = summarize(replay.records, replay.gaps, replay.end_time, slo_ttft_ms=cfg.slo_ttft_p90_ms, slo_itl_ms=cfg.slo_itl_p90_ms)
    pre_role = "prefill" if cfg.disaggregated else "both"
    hits = queries = 0
    for w in replay.workers.values():
        if w.role == pre_role:
            hits += w.sched.prefix_hits
            queries += w.sched.prefix_queries
    s["hit_rate"] = round(hits / queries, 5) if queries else None
    if bound is True:
        n = cfg.prefill if cfg.disaggregated else cfg.workers
        bound = fleet_bound(replay.wl, cfg.engine.block_size, max(1, n) * (replay.num_gpu_blocks - 1)) if not cfg.planner else None
    if isinstance(bound, dict) and bound.get("hit_rate"):
        s["fleet_bound_hit_rate"] = round(bound["hit_rate"], 5)
        s["oracle_hit_rate"] = round(bound["oracle_hit_rate"], 5)
        s["hit_share_of_bound"] = round(s["hit_rate"] / bound["hit_rate"], 4) if s["hit_rate"] is not None else None
    s["gpu_seconds"] = round(replay.gpu_seconds(), 1)
    s["preemptions"] = sum(w.sched.num_preemptions for w in replay.workers.values())
    if cfg.disaggregated:  # where each request was prefilled, by the frontend's decision (orchestrator/disagg/decision.py)
        reasons: dict[str, int] = {}
        for r in replay.records:
            reasons[r.disagg or "-"] = reasons.get(r.disagg or "-", 0) + 1
        s["disagg_reasons"] = reasons
    s["workers_peak"] = {role: max([n for _, r, n in replay.fleet_log if r == role], default=0) for role in replay.roles}
    return {"label": label, "policy": cfg.frontend.router.policy, "summary": s, "wall_s": round(replay.wall_s, 2),
            "events": replay.clock.events_run,
            "fleet": [[round(t, 3), role, n] for t, role, n in replay.fleet_log],
            "ttft_s": [round(r.ttft, 5) for r in replay.records if r.ttft is not None]}


def _f(x, nd: int = 1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def summary_table(results: list[dict], title: str = "kvyard replay"):
    from rich.table import Table

    t = Table(title=title)
    cols = ["run", "TTFT p50", "p90", "p99", "ITL p50", "p90", "E2E p50", "p90", "req/s", "out tok/s", "hit rate", "% bound",
            "GPU-s", "min in SLA", "wall s"]
    for c in cols:
        t.add_column(c, justify="left" if c == "run" else "right")
    for r in results:
        s = r["summary"]
        share = s.get("hit_share_of_bound")
        sla = f"{s['minutes_within_sla']}/{s['minutes_total']}" if "minutes_within_sla" in s else "-"
        t.add_row(r["label"], _f(s["ttft_ms"]["p50"]), _f(s["ttft_ms"]["p90"]), _f(s["ttft_ms"]["p99"]), _f(s["itl_ms"]["p50"], 2),
                  _f(s["itl_ms"]["p90"], 2), _f(s["e2e_ms"]["p50"]), _f(s["e2e_ms"]["p90"]), _f(s["req_per_s"], 2),
                  _f(s["output_tok_per_s"], 0), "-" if s["hit_rate"] is None else f"{s['hit_rate']:.1%}",
                  "-" if share is None else f"{share:.1%}", _f(s["gpu_seconds"], 0), sla, _f(r["wall_s"], 1))
    t.caption = "times in ms (profile time); hit rate: prompt tokens from the prefix caches; % bound: of the fleet bound's"
    return t


def plot(results: list[dict], path: Path, title: str = "kvyard replay") -> Path:
    """TTFT CDF per run; with a planner or SLO, replicas and per-minute TTFT p90 / SLA over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = any(len(r["fleet"]) > len({row[1] for row in r["fleet"]}) or "minutes_within_sla" in r["summary"] for r in results)
    fig, axes = plt.subplots(3 if timeline else 1, 1, figsize=(10, 10 if timeline else 4.5), squeeze=False)
    ax = axes[0][0]
    for r in results:
        v = np.sort(np.asarray(r["ttft_s"], dtype=float) * 1000.0)
        if v.size:
            ax.plot(v, np.arange(1, v.size + 1) / v.size, label=f"{r['label']} (p90 {r['summary']['ttft_ms']['p90']:,.0f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if timeline:
        ax1, ax2 = axes[1][0], axes[2][0]
        for r in results:
            for role in sorted({row[1] for row in r["fleet"]}):
                pts = [(t / 60.0, n) for t, rr, n in r["fleet"] if rr == role]
                end = r["summary"]["duration_s"] / 60.0
                xs, ys = [p[0] for p in pts] + [end], [p[1] for p in pts] + [pts[-1][1]]
                ax1.step(xs, ys, where="post", label=f"{r['label']} {role}")
            mins = r["summary"]["minutes"]
            ax2.plot([m["minute"] for m in mins], [m["ttft_p90_ms"] or np.nan for m in mins], lw=1, label=r["label"])
            miss = [m["minute"] for m in mins if not m["ok"]]
            if miss:
                ax2.scatter(miss, [1.0] * len(miss), marker="|", s=60)
        ax1.set_ylabel("workers (starting + ready)")
        ax1.legend(fontsize=7, ncol=3)
        ax1.grid(alpha=0.3)
        ax2.set_yscale("log")
        ax2.set_ylabel("TTFT p90 per minute (ms)")
        ax2.set_xlabel("minute (| marks a minute outside the SLA)")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=7)
    import textwrap

    fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
