"""Garbage-collector pauses of the frontend, with `frontend.gc_freeze` on (the default) and off, side by side.

    PYTHONPATH=. .venv/bin/python benchmarks/gc_pauses.py [--seconds 60] [--rounds 2]

Every collection stops the frontend's one event loop (orchestrator/heap.py). Two measurements:
  in-process   the app built as `kvyard frontend` builds it, with the sim's tokenizer loaded and its fast encoder
               checked: one full collection's time (the best of 5) before and after heap.settle()
  under load   two sim engines (KV events on), two `kvyard frontend` processes of this tree on them, one with
               `--set frontend.gc_freeze=false`; each in turn (rotated per round) streams 64-token prompts with 512
               output tokens at concurrency 256, closed loop, for --seconds; its own `kvyard_gc_pause_seconds`
               (orchestrator/metrics.py) is read from /metrics before and after: collections and their seconds per
               generation, and collections that took 25 ms or more (from the histogram's buckets)
Needs Redis on 127.0.0.1:6379. Writes benchmarks/results/gc_pauses.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import result_header  # noqa: E402
from benchmarks.frontend_cpu import closed_loop, frontend, long_run, short_bodies, start_sims, stop_sims  # noqa: E402
from benchmarks.frontend_overhead import cpu_seconds, wait_http  # noqa: E402
from orchestrator.testing import free_port  # noqa: E402
from workers.sim.backend import SIM_TOKENIZER_DIR  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SLOW_S = 0.025


def in_process() -> dict:
    from orchestrator.app import create_app
    from orchestrator.config import FrontendConfig
    from orchestrator.heap import settle
    from orchestrator.tokenizer import load_tokenizer

    create_app(FrontendConfig())
    load_tokenizer(str(SIM_TOKENIZER_DIR)).wait_fast(120)

    def full_ms() -> float:
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            gc.collect()
            best = min(best, time.perf_counter() - t)
        return round(best * 1000, 3)

    before = {"tracked_objects": len(gc.get_objects()), "full_collection_ms": full_ms()}
    settle("the benchmark's start-up")
    after = {"tracked_objects": len(gc.get_objects()), "frozen": gc.get_freeze_count(), "full_collection_ms": full_ms()}
    gc.unfreeze()
    return {"before_settle": before, "after_settle": after}


def _gc_series(text: str) -> dict:
    """kvyard_gc_pause_seconds per generation: count, sum, and how many took SLOW_S or more."""
    out: dict = {}
    for line in text.splitlines():
        if not line.startswith("kvyard_gc_pause_seconds"):
            continue
        name, value = line.rsplit(" ", 1)
        gen = name.split('generation="', 1)[1].split('"', 1)[0]
        g = out.setdefault(gen, {"count": 0.0, "sum": 0.0, "le": {}})
        if name.startswith("kvyard_gc_pause_seconds_count"):
            g["count"] = float(value)
        elif name.startswith("kvyard_gc_pause_seconds_sum"):
            g["sum"] = float(value)
        elif name.startswith("kvyard_gc_pause_seconds_bucket"):
            le = name.split('le="', 1)[1].split('"', 1)[0]
            g["le"][le] = float(value)
    for g in out.values():
        below = max((v for le, v in g["le"].items() if le != "+Inf" and float(le) < SLOW_S - 1e-9), default=0.0)
        g["slow"] = g["count"] - below
        del g["le"]
    return out


async def _metrics(session: aiohttp.ClientSession, port: int) -> dict:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
        return _gc_series(await r.text())


async def under_load(args) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="kvyard-gc-"))
    prefix = f"kvyard-bench-{uuid.uuid4().hex[:6]}"
    engines, disc = await start_sims(tmp, prefix, args.redis_url, args.speedup)
    modes = {"freeze": (), "no-freeze": ("--set", "frontend.gc_freeze=false")}
    ports = {k: free_port() for k in modes}
    procs = {k: frontend(ports[k], args.redis_url, prefix, tmp / f"frontend-{k}.log", ROOT, extra) for k, extra in modes.items()}
    rows: list[dict] = []
    try:
        async with aiohttp.ClientSession() as session:
            for p in ports.values():
                await wait_http(f"http://127.0.0.1:{p}/health", 60)
            await asyncio.sleep(3.0)  # the pool's first refresh, the tokenizer's load and check
            for p in ports.values():
                await closed_loop(f"http://127.0.0.1:{p}", 4, short_bodies(8, 16, 99))
            await asyncio.sleep(2.0)
            names = list(modes)
            for rnd in range(args.rounds):
                for k in names[rnd % 2:] + names[:rnd % 2]:
                    before, cpu0 = await _metrics(session, ports[k]), cpu_seconds(procs[k].pid)
                    t0, res, n = time.perf_counter(), [], 0
                    while time.perf_counter() - t0 < args.seconds:
                        if args.workload == "long":  # multi-turn chats of ~19k-token prompts (the chunk cache fills)
                            got, _ = await long_run(f"http://127.0.0.1:{ports[k]}", args.conversations, 5, 1000 * rnd + n + 11)
                        else:
                            got, _ = await closed_loop(f"http://127.0.0.1:{ports[k]}", args.concurrency,
                                                       short_bodies(args.concurrency, 512, 1000 * rnd + n))
                        res += got
                        n += 1
                    wall, cpu = time.perf_counter() - t0, cpu_seconds(procs[k].pid) - cpu0
                    after = await _metrics(session, ports[k])
                    gens = {g: {"collections": int(after[g]["count"] - before.get(g, {}).get("count", 0)),
                                "seconds": round(after[g]["sum"] - before.get(g, {}).get("sum", 0.0), 4),
                                f"at_least_{int(SLOW_S * 1000)}ms": int(after[g]["slow"] - before.get(g, {}).get("slow", 0))}
                            for g in sorted(after)}
                    ok = [r for r in res if r["ok"]]
                    ttfts = sorted(r["ttft_s"] * 1000 for r in ok)
                    row = {"round": rnd, "mode": k, "requests": len(res), "errors": len(res) - len(ok), "wall_s": round(wall, 1),
                           "ttft_p50_ms": round(ttfts[len(ttfts) // 2], 1) if ttfts else None,
                           "ttft_p90_ms": round(ttfts[int(0.9 * (len(ttfts) - 1))], 1) if ttfts else None,
                           "cpu_s": round(cpu, 2), "gc_seconds": round(sum(g["seconds"] for g in gens.values()), 4),
                           "gc_share_of_cpu": round(sum(g["seconds"] for g in gens.values()) / cpu, 4) if cpu else None,
                           "generations": gens}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        await stop_sims(engines, disc, procs)
    return rows


def render(result: dict, concurrency: int, seconds: float) -> list[str]:
    ip = result["in_process"]
    md = ["# Garbage-collector pauses of the frontend: gc_freeze on and off", "",
          f"`{result['command']}`; {result['when']}, {result['machine']}, load {result['loadavg']['start']}.", "",
          f"In-process, the app and the sim's tokenizer loaded: a full collection takes "
          f"{ip['before_settle']['full_collection_ms']} ms over {ip['before_settle']['tracked_objects']:,} tracked objects; "
          f"after heap.settle() {ip['after_settle']['full_collection_ms']} ms over {ip['after_settle']['tracked_objects']:,} "
          f"({ip['after_settle']['frozen']:,} frozen).", "",
          f"Under load ({result.get('workload', 'stream')} workload, {seconds:g} s per frontend and round):", "",
          "| round | gc_freeze | requests / s | TTFT p50 / p90 ms | CPU ms / request | GC seconds (gen 0 / 1 / 2) "
          "| full collections: count, mean ms | collections >= 25 ms | GC share of CPU |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in result["under_load"]:
        g = r["generations"]
        secs = " / ".join(f"{g.get(k, {}).get('seconds', 0):.3f}" for k in ("0", "1", "2"))
        slow = sum(v[f"at_least_{int(SLOW_S * 1000)}ms"] for v in g.values())
        full = g.get("2", {"collections": 0, "seconds": 0.0})
        mean = f"{full['seconds'] / full['collections'] * 1000:.0f}" if full["collections"] else "-"
        ttft = f"{r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f}" if r.get("ttft_p50_ms") is not None else "-"
        md.append(f"| {r['round']} | {'on' if r['mode'] == 'freeze' else 'off'} | {r['requests'] / r['wall_s']:.1f} | {ttft} | "
                  f"{r['cpu_s'] / max(1, r['requests']) * 1000:.2f} | {secs} | {full['collections']}, {mean} | {slow} | "
                  f"{r['gc_share_of_cpu']:.1%} |")
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="load per frontend and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=256, help="streams at once (stream workload)")
    ap.add_argument("--workload", choices=["stream", "long"], default="stream",
                    help="stream: 64-token prompts, 512 output tokens; long: multi-turn chats of ~19k-token prompts")
    ap.add_argument("--conversations", type=int, default=8, help="chats at once (long workload)")
    ap.add_argument("--speedup", type=float, default=2.0)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--out", default="gc_pauses")
    ap.add_argument("--render", type=Path, default=None, help="only rewrite the .md from this gc_pauses.json")
    a = ap.parse_args()
    if a.render:
        saved = json.loads(a.render.read_text())
        a.render.with_suffix(".md").write_text("\n".join(render(saved, a.concurrency, a.seconds)) + "\n")
        return
    result = result_header("gc_pauses") | {"command": "benchmarks/gc_pauses.py " + " ".join(sys.argv[1:]), "workload": a.workload}
    result["in_process"] = in_process()
    print(json.dumps(result["in_process"]), flush=True)
    result["under_load"] = asyncio.run(under_load(a))
    result["loadavg"]["end"] = round(os.getloadavg()[0], 2)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.out}.json").write_text(json.dumps(result, indent=1) + "\n")
    md = render(result, a.concurrency, a.seconds)
    (RESULTS / f"{a.out}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
