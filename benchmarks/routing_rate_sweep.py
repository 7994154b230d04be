"""kv vs round-robin on the Mooncake trace at several request rates: where does the routing target hold?

The issue's target is read at "a stated request rate where round-robin's TTFT p90 is at least 3× its unloaded
value": kv's TTFT p90 at most a third of round-robin's. Both p90s move with the rate, and round-robin's swings from
round to round near saturation, so one rate and one round say little. This runs `python -m benchmarks routing` (kv and
round-robin only, fresh clusters, `--repeats` rounds each) at every trace compression given, measures round-robin's
unloaded p90 once (the first compression's run), and writes one table and one plot:

    per rate: kv and round-robin TTFT p50/p90, round-robin's p90 over its unloaded p90 (must be ≥ 3 for the target
    to apply), kv/rr p90 (median of the rounds' own ratios, and each round's), kv's hit rate as % of the fleet bound,
    and where each policy's TTFT went by the engines' own histograms (queue vs prefill).

    .venv/bin/python -m benchmarks.routing_rate_sweep --compressions 5,6,7,8 --repeats 2 [--num-gpu-blocks 59064]

Each compression's full report goes to benchmarks/results/<out>/c<compression>.{json,md,png}; the summary to
benchmarks/results/<out>.{json,md,png}. About 6 minutes per compression and round on this 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import routing  # noqa: E402

RESULTS = routing.RESULTS
fmt = routing.fmt


def summarise(c: float, res: dict, unloaded_p90: float | None) -> dict:
    tr = res["trace"]
    kv, rr = tr["runs"]["kv"], tr["runs"]["round-robin"]
    rounds = tr.get("kv_over_rr_p90_rounds") or [tr["kv_over_rr_p90"]]

    def phases(r):
        ph = r.get("engine_phases_ms") or {}
        return {k: (ph.get(k) or {}).get("mean") for k in ("queue", "prefill")}
    return {
        "compression": c, "rate_profile": round(tr["params"]["rate_profile"], 2),
        "kv": {"ttft_ms": kv["ttft_ms"], "hit_over_bound_pct": round(tr["kv_hit_over_bound_pct"], 1), "phases_ms": phases(kv),
               "round_p90s": [x["ttft_ms"]["p90"] for x in kv.get("rounds", [kv])]},
        "round_robin": {"ttft_ms": rr["ttft_ms"], "phases_ms": phases(rr), "round_p90s": [x["ttft_ms"]["p90"] for x in rr.get("rounds", [rr])],
                        "p90_over_unloaded": round(rr["ttft_ms"]["p90"] / unloaded_p90, 2) if unloaded_p90 else None},
        "kv_over_rr_p90": round(float(np.median(rounds)), 4), "kv_over_rr_p90_rounds": [round(x, 4) for x in rounds],
        "ttft_floor_ms": tr.get("ttft_floor_ms"),
    }


def render(out: dict) -> str:
    p = out["params"]
    L = ["# kv vs round-robin across request rates (Mooncake trace, 8 sim workers)", "",
         f"Run {out['when']} on {out['machine']}; {p['repeats']} round(s) per rate, each policy on a fresh `kvyard up`, "
         f"{p['num_gpu_blocks']} KV blocks per worker, first {p['requests']} requests of the trace, profile time "
         "(H200 Llama-3.1-8B-FP8 profile, sim speed-up 0.25). Per-rate reports: "
         f"`benchmarks/results/{p['out']}/c<compression>.md`.", "", "```", out["command"], "```", ""]
    un = out.get("unloaded_ms")
    if un:
        L += [f"Round-robin unloaded (the first {p['unloaded_requests']} requests one at a time, max_tokens 1): TTFT p50 "
              f"{fmt(un['p50'])} ms, p90 {fmt(un['p90'])} ms. The target applies where round-robin's loaded p90 is at least "
              f"3× that: {fmt(3 * un['p90'], 0)} ms.", ""]
    L += ["| compression | req/s | kv p50 | kv p90 | rr p50 | rr p90 | rr p90 / unloaded | kv/rr p90 (rounds) | target ≤ ⅓ | "
          "kv hits % of bound | kv queue + prefill | rr queue + prefill |",
          "|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|"]
    for r in out["rates"]:
        kv, rr = r["kv"], r["round_robin"]
        applies = rr["p90_over_unloaded"] is None or rr["p90_over_unloaded"] >= 3
        verdict = ("met" if r["kv_over_rr_p90"] <= 1 / 3 else "missed") + ("" if applies else " (rr < 3× unloaded)")
        L.append(f"| {r['compression']:g} | {fmt(r['rate_profile'])} | {fmt(kv['ttft_ms']['p50'], 0)} | {fmt(kv['ttft_ms']['p90'], 0)} | "
                 f"{fmt(rr['ttft_ms']['p50'], 0)} | {fmt(rr['ttft_ms']['p90'], 0)} | {fmt(rr['p90_over_unloaded'], 2)} | "
                 f"**{fmt(r['kv_over_rr_p90'], 3)}** ({', '.join(fmt(x, 3) for x in r['kv_over_rr_p90_rounds'])}) | {verdict} | "
                 f"{fmt(kv['hit_over_bound_pct'])}% | {fmt(kv['phases_ms']['queue'], 0)} + {fmt(kv['phases_ms']['prefill'], 0)} | "
                 f"{fmt(rr['phases_ms']['queue'], 0)} + {fmt(rr['phases_ms']['prefill'], 0)} |")
    L += ["", "Times in ms (profile time); rows are medians over the rounds, kv/rr the median of the rounds' own ratios. "
          "Queue + prefill: mean ms per request from the engines' histograms (waiting for the scheduler, then the prefill "
          "steps to the first token). Per round, TTFT p90 kv / round-robin:", ""]
    for r in out["rates"]:
        L.append(f"- compression {r['compression']:g}: " + "; ".join(
            f"{fmt(a, 0)} / {fmt(b, 0)}" for a, b in zip(r["kv"]["round_p90s"], r["round_robin"]["round_p90s"])))
    return "\n".join(L + [""])


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate_profile"] for r in out["rates"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(rates, [r["kv"]["ttft_ms"]["p90"] for r in out["rates"]], "o-", label="kv p90")
    a.plot(rates, [r["round_robin"]["ttft_ms"]["p90"] for r in out["rates"]], "s-", label="round-robin p90")
    if out.get("unloaded_ms"):
        a.axhline(3 * out["unloaded_ms"]["p90"], color="grey", ls="--", label="3× round-robin unloaded p90")
    a.set_xlabel("request rate (req/s, profile time)")
    a.set_ylabel("TTFT p90 (ms)")
    a.set_title("TTFT p90 vs rate")
    a.legend()
    for r in out["rates"]:
        b.plot([r["rate_profile"]] * len(r["kv_over_rr_p90_rounds"]), r["kv_over_rr_p90_rounds"], ".", color="tab:blue", alpha=0.5)
    b.plot(rates, [r["kv_over_rr_p90"] for r in out["rates"]], "o-", color="tab:blue", label="kv / round-robin p90 (median, rounds)")
    b.axhline(1 / 3, color="tab:red", ls="--", label="target ⅓")
    b.set_xlabel("request rate (req/s, profile time)")
    b.set_ylim(0, max(0.6, max(x for r in out["rates"] for x in r["kv_over_rr_p90_rounds"]) * 1.1))
    b.set_title("kv / round-robin TTFT p90")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compressions", default="5,6,7,8", help="trace time / profile time, one run set per value")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-gpu-blocks", type=int, default=59064, help="per worker (59064: the H200 profile's capacity)")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--unloaded-requests", type=int, default=40)
    ap.add_argument("--out", default="routing_rate_sweep")
    args = ap.parse_args(argv)
    comps = [float(x) for x in args.compressions.split(",") if x]
    (RESULTS / args.out).mkdir(parents=True, exist_ok=True)
    out: dict = {"benchmark": "routing_rate_sweep", "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "machine": f"{__import__('os').cpu_count()} CPUs, Python {sys.version.split()[0]}", "params": vars(args),
                 "command": "python -m benchmarks.routing_rate_sweep " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "rates": []}
    unloaded = None
    for i, c in enumerate(comps):
        name = f"{args.out}/c{c:g}"
        skip = "shared" if i == 0 else "shared,unloaded"
        routing.main(["--compression", f"{c:g}", "--num-gpu-blocks", str(args.num_gpu_blocks), "--requests", str(args.requests),
                      "--unloaded-requests", str(args.unloaded_requests), "--skip", skip, "--policies", "kv,round-robin",
                      "--repeats", str(args.repeats), "--out", name])
        res = json.loads((RESULTS / f"{name}.json").read_text())
        if i == 0 and res["trace"].get("unloaded"):
            unloaded = res["trace"]["unloaded"]["ttft_ms"]
            out["unloaded_ms"] = unloaded
        out["rates"].append(summarise(c, res, unloaded["p90"] if unloaded else None))
        (RESULTS / f"{args.out}.json").write_text(json.dumps(out, indent=1))  # what is done so far survives a stop
        (RESULTS / f"{args.out}.md").write_text(render(out))
    plot(out, RESULTS / f"{args.out}.png")
    print(render(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
