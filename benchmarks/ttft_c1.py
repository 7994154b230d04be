"""The TTFT a router adds at concurrency 1: kvyard beside vllm-router and the SGLang gateway, one request at a time.

    scripts/install_routers.sh    # once: vllm-router 0.1.17 and sglang-router 0.3.2 in their own venvs
    PYTHONPATH=. .venv/bin/python benchmarks/ttft_c1.py [--requests 300] [--speedups 2,200] [--baseline DIR]
        [--routers kvyard-kv,vllm-router-rr,sglang-ca]

One sim engine (KV events on) per speed-up and every router in front of it at once (each on its own port; the
engine's URL given to the Rust routers, the engine registered in Redis for kvyard, as benchmarks/routers_compare.py
starts them). A client sends one streamed chat request at a time (64-token prompts, 16 output tokens), in turns:
each turn sends one request straight to the engine and one through each router, in an order rotated every turn, so
drift in the machine's load falls on every target alike. TTFT is the time to the first content chunk. A router's
added TTFT is its TTFT minus the direct TTFT of the same turn; reported: the median over the turns (the first
--warmup turns dropped), and p50 / p90 TTFT per target.
Each request finds the router idle for a few engine round trips (the other targets' turns): at speed-up 2 the engine
takes ~10 ms to its first token, so the router's code runs with cold caches, as it does at concurrency 1 in
production; at speed-up 200 the turns come back to back.
With --baseline DIR (a kvyard checkout, C extensions copied in when missing), kvyard-baseline-kv runs the code of DIR
as a further router, for an A/B of a change in the same turns. Writes benchmarks/results/<--out>.{json,md}
(default ttft_c1).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.routers_compare import MODEL, Fleet, Router, build_parser, check_baseline  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def paired_added(direct: list[float | None], routed: list[float | None], warmup: int) -> list[float]:
    """routed − direct for each turn past the warm-up where both answered."""
    return [r - d for d, r in list(zip(direct, routed))[warmup:] if d is not None and r is not None]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def ttft(session, url: str, text: str) -> float | None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 16, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    first = None
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            await r.read()
            return None
        async for line in r.content:
            if first is None and line.startswith(b"data:") and b'"content"' in line:
                first = time.perf_counter() - t0
    return first


async def run_speedup(args, speedup: float, tmp: Path) -> dict:
    import aiohttp

    from benchmarks.frontend_cpu import text

    fargs = copy.copy(args)
    fargs.engines, fargs.num_gpu_blocks = 1, 40000
    labels = args.routers.split(",") + (["kvyard-baseline-kv"] if args.baseline else [])
    rng = random.Random(11)
    async with Fleet(fargs, speedup, tmp, f"c1x{speedup:g}") as fleet:
        routers = []
        try:
            for i, label in enumerate(labels):
                rargs = copy.copy(fargs)
                rargs.router_port = args.router_port + 2 * i  # +1 is each Rust router's Prometheus port
                routers.append(await Router(label, rargs, fleet, tmp).__aenter__())
            targets = [("direct", fleet.urls[0])] + [(r.label, r.url) for r in routers]
            got: dict[str, list[float | None]] = {name: [] for name, _ in targets}
            async with aiohttp.ClientSession() as s:
                for _ in range(5):  # connections, tokenizer and first-request costs out of the way
                    for _, url in targets:
                        await ttft(s, url, text(rng, 64))
                for turn in range(args.requests):
                    k = turn % len(targets)
                    for name, url in targets[k:] + targets[:k]:
                        t = await ttft(s, url, text(rng, 64))
                        got[name].append(None if t is None else t * 1e3)
        finally:
            for r in routers:
                await r.__aexit__()
    row = {"speedup": speedup, "turns": args.requests, "warmup": args.warmup, "targets": {}}
    for name, vals in got.items():
        ok = [v for v in vals[args.warmup:] if v is not None]
        entry = {"ok": len(ok), "failed": sum(v is None for v in vals), "ttft_p50_ms": round(pct(ok, 0.5), 3) if ok else None,
                 "ttft_p90_ms": round(pct(ok, 0.9), 3) if ok else None}
        if name != "direct":
            added = paired_added(got["direct"], vals, args.warmup)
            entry["added_ms"] = {"p50": round(statistics.median(added), 3) if added else None,
                                 "p90": round(pct(added, 0.9), 3) if added else None}
        row["targets"][name] = entry
    return row


def report(out: dict, name: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1))
    runs = out["runs"]
    labels = [n for n in runs[0]["targets"] if n != "direct"]
    lines = [f"`{out['command']}`: one sim engine, every router in front of it, one streamed chat request at a time "
             f"(64-token prompts, 16 output tokens), in turns rotated over the engine itself and each router. Added = "
             f"the router's TTFT minus the engine's own in the same turn, median (p90) over {runs[0]['turns'] - out['warmup']} "
             f"turns. Machine: {out['machine']}, load {out['loadavg']}.", "",
             "| router | " + " | ".join(f"added at speed-up {r['speedup']:g}, ms" for r in runs)
             + " | " + " | ".join(f"TTFT p50 at speed-up {r['speedup']:g}, ms" for r in runs) + " |",
             "|---|" + "---|" * (2 * len(runs))]
    for lb in ["direct", *labels]:
        added = [r["targets"][lb].get("added_ms") for r in runs]
        cells = ["–" if a is None else f"{a['p50']:.2f} ({a['p90']:.2f})" for a in added]
        lines.append(f"| {lb} | " + " | ".join(cells) + " | "
                     + " | ".join(f"{r['targets'][lb]['ttft_p50_ms']:.2f}" for r in runs) + " |")
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=300, help="turns (each: the engine once and every router once)")
    ap.add_argument("--warmup", type=int, default=20, help="turns left out of the figures")
    ap.add_argument("--speedups", default="2,200")
    ap.add_argument("--routers", default="kvyard-kv,vllm-router-rr,sglang-ca")
    ap.add_argument("--baseline", default=None, help="another kvyard checkout, run as kvyard-baseline-kv")
    ap.add_argument("--router-port", type=int, default=19640)
    ap.add_argument("--base-port", type=int, default=19630)
    ap.add_argument("--out", default="ttft_c1")
    a = ap.parse_args()
    args = build_parser().parse_args([])  # routers_compare's defaults (Redis URL, context length)
    args.requests, args.warmup, args.routers, args.router_port, args.base_port = (
        a.requests, a.warmup, a.routers, a.router_port, a.base_port)
    args.baseline = str(Path(a.baseline).resolve()) if a.baseline else None
    if args.baseline:
        check_baseline(Path(args.baseline))
    for label in args.routers.split(","):
        venv, exe = {"vllm": (".venv-vllm-router", "vllm-router"), "sglang": (".venv-sglang-router", "smg")}.get(
            label.split("-")[0], (None, None))
        if venv and not (ROOT / venv / "bin" / exe).exists():
            raise SystemExit(f"{ROOT / venv} missing: run scripts/install_routers.sh")
    from benchmarks.common import result_header

    cmd = "benchmarks/ttft_c1.py " + " ".join(sys.argv[1:])
    out = {**result_header("ttft_c1"), "command": cmd.strip(), "warmup": a.warmup, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for sp in (float(x) for x in a.speedups.split(",")):
            row = asyncio.run(run_speedup(args, sp, Path(tmp)))
            out["runs"].append(row)
            print(json.dumps(row), flush=True)
    out["loadavg"]["end"] = round(os.getloadavg()[0], 2)
    report(out, a.out)


if __name__ == "__main__":
    main()
