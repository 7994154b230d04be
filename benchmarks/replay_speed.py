"""How fast kvyard replay runs, beside Dynamo 1.6.1's replay on the same trace and fleet.

    .venv/bin/python benchmarks/replay_speed.py [--cases trace64,tiled512] [--cpu 1]

Cases (both replays on the same JSONL, engines on the mocker's terms: Dynamo's converted H200 perf data, block size
64, 16,384 KV blocks per worker; kvyard with the kv policy at the frontend's defaults, Dynamo with kv_router):
    trace64    the Mooncake conversation trace, 12,031 requests, 64 workers, at its own rate
    tiled512   100,000 requests on 512 workers: the conversation trace tiled 9 times (each copy its own hash ids,
               copies interleaved 0.4 s apart), the first 100,000 rows: 8.3x the trace's rate, the same per-worker load
               as the trace on 62 workers
Each replay runs in its own process pinned to one CPU (--cpu); reported: wall seconds, CPU seconds (user + system of
that process), peak RSS (MB), requests completed. The machine is shared: CPU seconds are the steadier figure.
Writes benchmarks/results/replay_speed.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.dynamo_compare import DYNAMO_VENV, convert_profile  # noqa: E402
from benchmarks.replay_compare import TRACE, machine, mocker_engine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

KVYARD_CHILD = r"""
import json, os, resource, sys, time
os.sched_setaffinity(0, {{{cpu}}})
from orchestrator.config import FrontendConfig
from orchestrator.replay import EngineSpec, Replay, ReplayConfig, load_mooncake
from orchestrator.replay.report import result_of
t0 = time.perf_counter()
wl = load_mooncake({trace!r})
cfg = ReplayConfig(workers={workers}, frontend=FrontendConfig(router={"policy": "kv"}),
                   engine=EngineSpec(profile={profile!r}, block_size=64, num_gpu_blocks=16384))
r = Replay(cfg, wl).run()
wall = time.perf_counter() - t0
s = result_of(r, "kv", bound=False)["summary"]
u = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"wall_s": wall, "replay_wall_s": r.wall_s, "cpu_s": u.ru_utime + u.ru_stime, "max_rss_mb": u.ru_maxrss / 1024,
                  "completed": s["completed"], "events": r.clock.events_run, "ttft_p90": s["ttft_ms"]["p90"], "hit_rate": s["hit_rate"]}}))
"""


def tile(src: Path, dest: Path, copies: int, limit: int, gap_s: float = 0.4) -> Path:
    """The trace `copies` times, each copy's hash ids offset past the others', copy k shifted by k × gap_s; sorted, cut."""
    rows = [json.loads(x) for x in src.read_text().splitlines() if x.strip()]
    span = 1 + max(h for r in rows for h in r["hash_ids"])
    t0 = rows[0]["timestamp"]
    out = []
    for k in range(copies):
        for r in rows:
            out.append({"timestamp": r["timestamp"] - t0 + k * gap_s * 1000.0, "input_length": r["input_length"],
                        "output_length": r["output_length"], "hash_ids": [h + k * span for h in r["hash_ids"]]})
    out.sort(key=lambda r: r["timestamp"])
    dest.write_text("\n".join(json.dumps(r) for r in out[:limit]) + "\n")
    return dest


def run_kvyard(trace: Path, workers: int, profile: str, cpu: int) -> dict:
    code = KVYARD_CHILD.format(cpu=cpu, trace=str(trace), workers=workers, profile=profile)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_dynamo(trace: Path, workers: int, engine: dict, cpu: int) -> dict:
    py = DYNAMO_VENV / "bin" / "python"
    cmd = ["taskset", "-c", str(cpu), str(py), str(ROOT / "benchmarks" / "dynamo_replay.py"), "--trace", str(trace), "--workers", str(workers), "--router", "kv_router",
           "--engine", json.dumps(engine)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, DYN_LOG="error", RUST_LOG="error"))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    d = json.loads(proc.stdout)
    s = d["summary"]
    return {"wall_s": wall, "replay_wall_s": d["wall_s"], "cpu_s": d.get("cpu_s"), "max_rss_mb": d["max_rss_mb"],
            "completed": s["completed_requests"], "ttft_p90": s["p90_ttft_ms"], "hit_rate": s["prefix_cache_reused_ratio"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="trace64,tiled512")
    ap.add_argument("--cpu", type=int, default=1, help="the CPU each replay is pinned to")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="kvyard-replay-speed-"))
    npz = convert_profile(tmp)
    engine = mocker_engine(npz, 64, 16384)
    cases = {"trace64": (TRACE, 64), "tiled512": (None, 512)}
    out = {"machine": machine(), "command": "benchmarks/replay_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "cases": []}
    for name in filter(None, args.cases.split(",")):
        trace, workers = cases[name]
        if trace is None:
            trace = tile(TRACE, tmp / "tiled.jsonl", 9, 100_000)
        n = sum(1 for _ in trace.open())
        print(f"[speed] {name}: {n} requests, {workers} workers", flush=True)
        k = run_kvyard(trace, workers, str(npz), args.cpu)
        print(f"   kvyard {k}", flush=True)
        d = run_dynamo(trace, workers, engine, args.cpu)
        print(f"   dynamo {d}", flush=True)
        out["cases"].append({"case": name, "requests": n, "workers": workers, "kvyard": k, "dynamo": d})
    write(out)
    return 0


def write(out: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "replay_speed.json").write_text(json.dumps(out, indent=1))
    m = out["machine"]
    L = ["# kvyard replay speed, beside Dynamo 1.6.1's replay", "",
         f"Run {m['when']} on {m['cpus']} shared CPUs (load average {m['loadavg']} at start); each replay in its own process "
         "pinned to one CPU. Both on the same JSONL, engines on the mocker's terms (block size 64, 16,384 KV blocks per worker); "
         "kvyard routes with kv (the frontend's defaults), Dynamo with kv_router. CPU = user + system seconds of the process "
         "(the steadier figure on a shared machine); wall includes start-up and loading the trace.", "",
         "```", out["command"], "```", "",
         "| case | requests | workers | replay | wall s | CPU s | peak RSS MB | completed | TTFT p90 ms | hit rate |",
         "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for c in out["cases"]:
        for who in ("kvyard", "dynamo"):
            r = c[who]
            cpu = "-" if r.get("cpu_s") is None else f"{r['cpu_s']:.1f}"
            L.append(f"| {c['case']} | {c['requests']:,} | {c['workers']} | {who} | {r['wall_s']:.1f} | {cpu} | {r['max_rss_mb']:,.0f} | "
                     f"{r['completed']:,} | {r['ttft_p90']:,.1f} | {r['hit_rate']:.2%} |")
    L += ["", "Targets: the conversation trace on 64 workers with kv in under 60 s on one core; 100,000 requests on 512 workers "
          "in under 10 minutes."]
    (RESULTS / "replay_speed.md").write_text("\n".join(L) + "\n")
    print("\n".join(L))


if __name__ == "__main__":
    raise SystemExit(main())
