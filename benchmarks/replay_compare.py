"""kvyard replay beside NVIDIA Dynamo's replay and beside kvyard's own real-time routing benchmark.

    scripts/install_dynamo.sh                                   # once: Dynamo 1.6.1 in .venv-dynamo
    .venv/bin/python benchmarks/replay_compare.py dynamo        # agreement (a): round-robin, engines on the mocker's terms
    .venv/bin/python -m benchmarks routing --policies kv,round-robin --skip unloaded,shared --compression 6 --repeats 3 \
        --out replay_agreement_realtime                          # the real-time side of (b)
    .venv/bin/python benchmarks/replay_compare.py realtime      # agreement (b): the replay at that run's settings
    .venv/bin/python benchmarks/replay_compare.py routing       # kv vs Dynamo's kv_router at 8, 32 and 128 workers

Engines "on the mocker's terms": kvyard's sim with Dynamo's mocker step timing (workers/sim/mocker_timing.py) on the
perf data Dynamo's own converter writes from the bundled H200 Llama-3.1-8B-FP8 profile (benchmarks/dynamo_compare.py
convert_profile), the same block size and KV blocks per worker as the mocker. Dynamo runs `dynamo.replay.run_trace_replay`
(benchmarks/dynamo_replay.py, in .venv-dynamo) on the very same JSONL file (a synthetic load is written out first).

Agreement (a): round-robin TTFT p50/p90 and ITL p50 (over every token gap, as Dynamo reports it) within 10 %.
Agreement (b): the replay with kvyard's own engine model at the real-time benchmark's settings (first N rows, compression,
OSL scale, block size, KV blocks, 8 workers): TTFT p50/p90 within 10 % of the real-time medians, hit rates within 2 points.
Routing: at each fleet size the whole trace at a load where round-robin's TTFT p90 is >= 3x its unloaded value (the trace
at 1/50 of that rate); kvyard kv and round-robin, Dynamo kv_router and round_robin, all four on the same engines.
Writes benchmarks/results/replay_agreement.{json,md} (dynamo, realtime) and replay_routing.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.dynamo_compare import DYNAMO_VENV, STANDIN, convert_profile, write_standin  # noqa: E402
from orchestrator.config import FrontendConfig  # noqa: E402
from orchestrator.replay import EngineSpec, Replay, ReplayConfig, load_mooncake, synthetic  # noqa: E402
from orchestrator.replay.report import result_of  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TRACE = ROOT / "benchmarks" / "data" / "mooncake_conversation_trace.jsonl"


def machine() -> dict:
    return {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
            "python": sys.version.split()[0], "loadavg": round(os.getloadavg()[0], 2)}


def dynamo_standins(tmp: Path) -> Path:
    """Inert stand-ins for `aisimulate_core` (with .sdk, ._native) and `aisimulate` (with .runner): Dynamo's planner and
    replay packages import them; neither installs from PyPI; the load-based planner never calls them."""
    write_standin(tmp)
    pkg = tmp / "aisimulate"
    pkg.mkdir(parents=True, exist_ok=True)
    for mod in ("__init__", "runner"):
        (pkg / f"{mod}.py").write_text(STANDIN)
    return tmp


def dynamo_run(trace: Path, workers: int, router: str, engine: dict, speedup: float = 1.0, per_request: bool = False,
               router_config: dict | None = None, planner_config: dict | None = None, standins: Path | None = None) -> dict:
    """Dynamo's replay in its own venv; its summary (ms), wall seconds and peak RSS."""
    py = DYNAMO_VENV / "bin" / "python"
    if not py.exists():
        raise SystemExit(f"{py} not found: run scripts/install_dynamo.sh first")
    cmd = [str(py), str(ROOT / "benchmarks" / "dynamo_replay.py"), "--trace", str(trace), "--workers", str(workers),
           "--router", router, "--engine", json.dumps(engine), "--speedup", str(speedup)]
    if per_request:
        cmd.append("--per-request")
    if router_config:
        cmd += ["--router-config", json.dumps(router_config)]
    env = dict(os.environ, DYN_LOG="error", RUST_LOG="error")
    if planner_config:
        cmd += ["--planner-config", json.dumps(planner_config)]
        env["PYTHONPATH"] = str(standins or dynamo_standins(Path(tempfile.mkdtemp(prefix="kvyard-standins-"))))
    # in a scratch folder: Dynamo's planner writes its HTML reports into the working directory
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tempfile.mkdtemp(prefix="kvyard-dynamo-run-"))
    if proc.returncode != 0:
        raise RuntimeError(f"Dynamo's replay failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def mocker_engine(npz: Path, block_size: int, num_gpu_blocks: int) -> dict:
    return {"engine": {"block_size": block_size, "num_gpu_blocks": num_gpu_blocks,
                       "timing_model": {"type": "external", "provider": "dynamo_profile", "config": {"path": str(npz)}}}}


def dynamo_row(d: dict) -> dict:
    s = d["summary"]
    return {"ttft_p50": s["median_ttft_ms"], "ttft_p90": s["p90_ttft_ms"], "ttft_p99": s["p99_ttft_ms"], "itl_p50": s["median_itl_ms"],
            "itl_p90": s["p90_itl_ms"], "hit_rate": s["prefix_cache_reused_ratio"], "wall_s": round(d["wall_s"], 2),
            "max_rss_mb": round(d["max_rss_mb"], 1), "completed": s["completed_requests"]}


def kvyard_row(res: dict) -> dict:
    s = res["summary"]
    return {"ttft_p50": s["ttft_ms"]["p50"], "ttft_p90": s["ttft_ms"]["p90"], "ttft_p99": s["ttft_ms"]["p99"],
            "itl_p50": s["itl_ms"]["p50"], "itl_p90": s["itl_ms"]["p90"], "hit_rate": s["hit_rate"], "wall_s": res["wall_s"],
            "completed": s["completed"], "share_of_bound": s.get("hit_share_of_bound")}


def frontend_for(policy: str, settings: dict) -> FrontendConfig:
    """The frontend config routing by `policy`, with `settings` (nested, as the config tree) over the defaults."""
    router = {**settings.get("router", {}), "policy": policy}
    return FrontendConfig(**{**settings, "router": router})


def kvyard_run(wl, workers: int, policy: str, engine: EngineSpec, bound: dict | bool = False, **kw) -> dict:
    cfg = ReplayConfig(workers=workers, engine=engine, frontend=frontend_for(policy, kw.pop("frontend", {})), **kw)
    r = Replay(cfg, wl).run()
    return result_of(r, policy, bound=bound)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b in (None, 0) else round(a / b, 4)


# ---------------------------------------------------------------- agreement (a): Dynamo

def agreement_dynamo(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvyard-replay-cmp-"))
    npz = convert_profile(tmp)
    engine = EngineSpec(profile=str(npz), block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks)
    dyn_engine = mocker_engine(npz, args.block_size, args.num_gpu_blocks)
    loads = []
    for scale in args.trace_scales:
        loads.append((f"conversation trace ×{scale:g}", TRACE, scale))
    syn = synthetic(args.synthetic, seed=7)
    syn_path = syn.write_mooncake(tmp / "synthetic.jsonl")
    loads.append((f"synthetic {args.synthetic}", syn_path, 1.0))
    rows = []
    for name, path, scale in loads:
        wl = load_mooncake(path, time_scale=scale)
        print(f"[dynamo agreement] {name}: {len(wl)} requests", flush=True)
        d = dynamo_row(dynamo_run(path, args.workers, "round_robin", dyn_engine, scale))
        k = kvyard_row(kvyard_run(wl, args.workers, "round-robin", engine))
        row = {"load": name, "requests": len(wl), "dynamo": d, "kvyard": k,
               "ratio": {m: ratio(k[m], d[m]) for m in ("ttft_p50", "ttft_p90", "itl_p50")}}
        row["agree"] = all(r is not None and abs(r - 1) <= 0.10 for r in row["ratio"].values())
        rows.append(row)
        print(f"   dynamo {d}\n   kvyard {k}\n   ratios {row['ratio']} agree={row['agree']}", flush=True)
    return {"machine": machine(), "workers": args.workers, "block_size": args.block_size, "num_gpu_blocks": args.num_gpu_blocks,
            "rows": rows}


# ---------------------------------------------------------------- agreement (b): real time

def agreement_realtime(args) -> dict:
    rt = json.loads(Path(args.realtime).read_text())
    p, tr = rt["params"], rt["trace"]
    wl = load_mooncake(TRACE, time_scale=p["compression"], limit=p["requests"], osl_scale=p["osl_scale"])
    engine = EngineSpec(block_size=p["block_size"], num_gpu_blocks=p["num_gpu_blocks"], max_model_len=p["max_model_len"])
    # The real-time frontend keeps its fixed durations in wall seconds while its engines run `speedup` times slower than
    # the profile: in profile time its pending-prediction TTL and scrape interval are speedup times theirs. The replay
    # runs in profile time, so those two are scaled to match the run (FrontendConfig's defaults otherwise).
    base = FrontendConfig()
    scaled = {"router": {"kv": {"pending_ttl_s": base.router.kv.pending_ttl_s * p["speedup"]}},
              "scrape_interval_s": base.scrape_interval_s * p["speedup"]}
    rows = []
    for policy in ("kv", "round-robin"):
        real = tr["runs"][policy]
        k = kvyard_row(kvyard_run(wl, p["workers"], policy, engine, frontend=scaled))
        unscaled = kvyard_row(kvyard_run(wl, p["workers"], policy, engine))
        jittered = []  # the real client sends late by a few ms (send lag): the replay with that much jitter, seeded
        for seed in range(args.jitter_seeds):
            jw = load_mooncake(TRACE, time_scale=p["compression"], limit=p["requests"], osl_scale=p["osl_scale"])
            rng = np.random.default_rng(seed)
            for req in jw.requests:
                req.arrival += float(rng.uniform(0.0, args.jitter_ms / 1000.0))
            jw.requests.sort(key=lambda req: req.arrival)
            jittered.append(kvyard_row(kvyard_run(jw, p["workers"], policy, engine, frontend=scaled)))
        rounds = [{"ttft_p50": x["ttft_ms"]["p50"], "ttft_p90": x["ttft_ms"]["p90"], "hit_rate": x["hit_rate"]}
                  for x in real.get("rounds", [real])]
        row = {"policy": policy, "realtime_median": {"ttft_p50": real["ttft_ms"]["p50"], "ttft_p90": real["ttft_ms"]["p90"],
                                                     "hit_rate": real["hit_rate"]}, "realtime_rounds": rounds, "replay": k,
               "replay_unscaled_frontend": unscaled, "frontend_scaled": scaled,
               "jitter": {"ms": args.jitter_ms, "seeds": args.jitter_seeds,
                          **{m: {"min": min(j[m] for j in jittered), "median": float(np.median([j[m] for j in jittered])),
                                 "max": max(j[m] for j in jittered)} for m in ("ttft_p50", "ttft_p90")}} if jittered else None}
        row["ratio"] = {m: ratio(k[m], row["realtime_median"][m]) for m in ("ttft_p50", "ttft_p90")}
        row["hit_points"] = round(100 * (k["hit_rate"] - real["hit_rate"]), 2)
        row["agree"] = all(abs(r - 1) <= 0.10 for r in row["ratio"].values()) and abs(row["hit_points"]) <= 2.0
        rows.append(row)
        print(f"[realtime agreement] {policy}: {row}", flush=True)
    unloaded = None
    if tr.get("unloaded"):  # the benchmark's unloaded reference: its first requests one at a time, max_tokens 1
        un = tr["unloaded"]
        seq = load_mooncake(TRACE, limit=un["requests"], osl_scale=1e-9)
        for i, req in enumerate(seq.requests):
            req.arrival = i * 600.0  # one at a time: each long done before the next
        k = kvyard_row(kvyard_run(seq, p["workers"], "round-robin", engine))
        unloaded = {"requests": un["requests"], "realtime": {"ttft_p50": un["ttft_ms"]["p50"], "ttft_p90": un["ttft_ms"]["p90"]},
                    "replay": k, "ratio": {m: ratio(k[m], un["ttft_ms"][m.split("_")[1]]) for m in ("ttft_p50", "ttft_p90")}}
        print(f"[realtime agreement] unloaded: {unloaded}", flush=True)
    return {"machine": machine(), "unloaded": unloaded, "realtime_command": rt.get("command"), "realtime_when": rt.get("when"),
            "realtime_loadavg": rt.get("loadavg"), "params": {k: p[k] for k in ("requests", "compression", "osl_scale", "block_size",
                                                                                "num_gpu_blocks", "workers", "speedup")},
            "rows": rows}


def write_agreement(part: str, data: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "replay_agreement.json"
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc[part] = data
    doc.setdefault("commands", {})[part] = "benchmarks/replay_compare.py " + " ".join(sys.argv[1:])
    path.write_text(json.dumps(doc, indent=1))
    L = ["# kvyard replay: agreement", "",
         "Written by `benchmarks/replay_compare.py` (the commands are at each section). Times in ms of profile time.", ""]
    a = doc.get("dynamo")
    if a:
        L += ["## (a) kvyard replay vs Dynamo 1.6.1 `run_trace_replay`, round-robin, engines on the mocker's terms", "",
              f"Run {a['machine']['when']} on {a['machine']['cpus']} shared CPUs (load average {a['machine']['loadavg']} at start). "
              f"{a['workers']} workers, block size {a['block_size']}, {a['num_gpu_blocks']} KV blocks per worker; kvyard's sim prices "
              "steps with Dynamo's mocker timing (workers/sim/mocker_timing.py) on the perf data Dynamo's converter writes from the "
              "bundled H200 profile; both replays read the same JSONL.", "",
              "```", doc["commands"]["dynamo"], "```", "",
              "| load | requests | TTFT p50 kvyard / Dynamo | TTFT p90 kvyard / Dynamo | ITL p50 kvyard / Dynamo | hit rate kvyard / Dynamo | within 10 % |",
              "|---|---:|---:|---:|---:|---:|---|"]
        for r in a["rows"]:
            k, d, q = r["kvyard"], r["dynamo"], r["ratio"]
            L.append(f"| {r['load']} | {r['requests']:,} | {k['ttft_p50']:.1f} / {d['ttft_p50']:.1f} ({q['ttft_p50']:.3f}) | "
                     f"{k['ttft_p90']:.1f} / {d['ttft_p90']:.1f} ({q['ttft_p90']:.3f}) | {k['itl_p50']:.3f} / {d['itl_p50']:.3f} "
                     f"({q['itl_p50']:.3f}) | {k['hit_rate']:.2%} / {d['hit_rate']:.2%} | {'yes' if r['agree'] else '**no**'} |")
        L.append("")
    for name in sorted(k for k in doc if k.startswith("realtime")):
        b = doc[name]
        q = b["params"]
        L += ["## (b) kvyard replay vs kvyard's real-time routing benchmark (benchmarks/routing.py)", "",
              f"Real-time run {b['realtime_when']} (load average {b['realtime_loadavg']}): `{b['realtime_command']}`; "
              f"replay {b['machine']['when']}. Settings both ran: the first {q['requests']} rows of the conversation trace, "
              f"arrivals compressed {q['compression']}×, OSL ×{q['osl_scale']}, {q['workers']} workers, block size {q['block_size']}, "
              f"{q['num_gpu_blocks']} KV blocks per worker, kvyard's own engine model (the H200 profile). The real-time figures "
              f"are medians of its rounds (profile time = wall × speed-up {q['speedup']}); the rounds are listed. The replay's "
              f"frontend durations that the real run kept in wall seconds (pending-prediction TTL, scrape interval) are scaled "
              f"by the speed-up to match; the last column is the replay with them unscaled.", "",
              "```", doc["commands"][name], "```", "",
              "| policy | TTFT p50 replay / real-time | TTFT p90 replay / real-time | hit rate replay / real-time | real-time rounds (p50, p90, hits) | agree | replay, frontend unscaled (p50, p90, hits) |",
              "|---|---:|---:|---:|---|---|---|"]
        for r in b["rows"]:
            k, m, q2 = r["replay"], r["realtime_median"], r["ratio"]
            rounds = "; ".join(f"{x['ttft_p50']:.0f}, {x['ttft_p90']:.0f}, {x['hit_rate']:.1%}" for x in r["realtime_rounds"])
            L.append(f"| {r['policy']} | {k['ttft_p50']:.1f} / {m['ttft_p50']:.1f} ({q2['ttft_p50']:.3f}) | {k['ttft_p90']:.1f} / "
                     f"{m['ttft_p90']:.1f} ({q2['ttft_p90']:.3f}) | {k['hit_rate']:.2%} / {m['hit_rate']:.2%} "
                     f"({r['hit_points']:+.2f} pt) | {rounds} | {'yes' if r['agree'] else '**no**'} | "
                     f"{r['replay_unscaled_frontend']['ttft_p50']:.0f}, {r['replay_unscaled_frontend']['ttft_p90']:.0f}, "
                     f"{r['replay_unscaled_frontend']['hit_rate']:.1%} |")
        js = [(r["policy"], r["jitter"]) for r in b["rows"] if r.get("jitter")]
        if js:
            L += ["", f"The replay again with each arrival delayed by a uniform 0–{js[0][1]['ms']:g} ms (profile; the real client's "
                  f"send lag is of that order), {js[0][1]['seeds']} seeds: "
                  + "; ".join(f"{pol} TTFT p50 {j['ttft_p50']['min']:.0f}–{j['ttft_p50']['max']:.0f} (median {j['ttft_p50']['median']:.0f}), "
                              f"p90 {j['ttft_p90']['min']:.0f}–{j['ttft_p90']['max']:.0f} (median {j['ttft_p90']['median']:.0f}) ms"
                              for pol, j in js) + "."]
        u = b.get("unloaded")
        if u:
            L += ["", f"Unloaded (round-robin, the first {u['requests']} requests one at a time, max_tokens 1): replay TTFT p50 "
                  f"{u['replay']['ttft_p50']:.1f} / p90 {u['replay']['ttft_p90']:.1f} ms, real-time {u['realtime']['ttft_p50']:.1f} / "
                  f"{u['realtime']['ttft_p90']:.1f} ms (replay / real-time {u['ratio']['ttft_p50']:.3f}, {u['ratio']['ttft_p90']:.3f})."]
        L.append("")
    (RESULTS / "replay_agreement.md").write_text("\n".join(L))
    print("\n".join(L))


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True)
    a = sub.add_parser("dynamo")
    a.add_argument("--workers", type=int, default=8)
    a.add_argument("--block-size", type=int, default=64)
    a.add_argument("--num-gpu-blocks", type=int, default=16384)
    a.add_argument("--trace-scales", type=float, nargs="+", default=[1.0, 2.0])
    a.add_argument("--synthetic", default="sessions:rate=6,requests=4000,osl=300")
    b = sub.add_parser("realtime")
    b.add_argument("--realtime", default=str(RESULTS / "replay_agreement_realtime.json"))
    b.add_argument("--name", default="realtime", help="the section's key in replay_agreement.json (one per real-time run)")
    b.add_argument("--jitter-ms", type=float, default=10.0, help="also replay with arrivals delayed uniformly by up to this")
    b.add_argument("--jitter-seeds", type=int, default=8)
    r = sub.add_parser("routing")
    from benchmarks.replay_routing import add_args

    add_args(r)
    args = ap.parse_args(argv)
    if args.part == "dynamo":
        write_agreement("dynamo", agreement_dynamo(args))
    elif args.part == "realtime":
        write_agreement(args.name, agreement_realtime(args))
    else:
        from benchmarks.replay_routing import run as routing_run

        routing_run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
