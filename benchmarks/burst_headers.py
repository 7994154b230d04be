"""A burst of streams sent at once: when each request's response headers and first token come back, per router.

aiperf reports TTFT only. This splits it: the response headers leave a router once the engine has taken the
request, so "time to headers" is how long the router itself held the request, and TTFT by send order shows
whether late arrivals pay for early ones. Same fleet for every router (benchmarks/routers_compare.py's Fleet and
Router: sim engines at --speedup, kvyard from this checkout or --baseline, the Rust routers from their venvs,
scripts/install_routers.sh), each router in turn, each with its own prompts.

    .venv/bin/python benchmarks/burst_headers.py [--routers kvyard-kv,vllm-router-rr] [--requests 256]

Writes benchmarks/results/burst_headers.{json,md}. Needs Redis on 127.0.0.1:6379 for kvyard.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.routers_compare import RESULTS, Fleet, Router, Words, build_parser, chat_body, check_baseline, warm  # noqa: E402


async def burst(url: str, bodies: list[dict]) -> list[dict]:
    """Every body sent at once, one connection each; per request: send offset, headers and first-token latency (s)."""
    out: list[dict] = []
    conn = aiohttp.TCPConnector(limit=len(bodies))
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        t00 = time.perf_counter()

        async def one(body: dict) -> None:
            t = time.perf_counter()
            first = None
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                headers = time.perf_counter() - t
                ok = r.status == 200
                async for line in r.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter() - t
            out.append({"sent_s": t - t00, "headers_s": headers, "ttft_s": first, "ok": ok and first is not None})

        await asyncio.gather(*(one(b) for b in bodies))
    return sorted(out, key=lambda r: r["sent_s"])


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 1)


def summary(rows: list[dict], parts: int = 8) -> dict:
    ok = [r for r in rows if r["ok"]]
    size = max(1, len(ok) // parts)
    groups = [ok[i * size:(i + 1) * size] for i in range(parts) if ok[i * size:(i + 1) * size]]
    return {"ok": len(ok), "requests": len(rows), "send_spread_ms": round(1000 * rows[-1]["sent_s"], 1),
            "headers_ms": {q: pct([r["headers_s"] for r in ok], v) for q, v in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9))},
            "ttft_ms": {q: pct([r["ttft_s"] for r in ok], v) for q, v in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9))},
            "headers_p50_by_send_order_ms": [round(1000 * statistics.median(r["headers_s"] for r in g)) for g in groups],
            "ttft_p50_by_send_order_ms": [round(1000 * statistics.median(r["ttft_s"] for r in g)) for g in groups]}


async def amain(args) -> dict:
    if args.baseline:
        check_baseline(Path(args.baseline))
    rc = build_parser().parse_args(["--engines", str(args.engines)] + (["--baseline", args.baseline] if args.baseline else []))
    rc.redis_url = args.redis_url
    tmp = Path(tempfile.mkdtemp(prefix="kvyard-burst-"))
    words = Words()
    runs: dict[str, list] = {}
    async with Fleet(rc, args.speedup, tmp, "burst") as fleet:
        for rnd in range(args.rounds):
            for k, label in enumerate(args.routers.split(",")):
                bodies = [chat_body(words.text(args.isl, (rnd * 100 + k) * 100000 + i), args.osl) for i in range(args.requests)]
                async with Router(label, rc, fleet, tmp) as router:
                    await warm(router)
                    s = summary(await burst(router.url, bodies))
                runs.setdefault(label, []).append(s)
                print(label, json.dumps(s), flush=True)
    return {"benchmark": "burst_headers", "machine": f"{os.cpu_count()} cores (shared)", "args": vars(args), "runs": runs}


def write(out: dict) -> None:
    a = out["args"]
    lines = [f"`benchmarks/burst_headers.py --routers {a['routers']} --requests {a['requests']} --engines {a['engines']} "
             f"--speedup {a['speedup']:g} --rounds {a['rounds']}`: {a['requests']} streams ({a['isl']}-token prompts, "
             f"{a['osl']} tokens out) sent at once to {a['engines']} sim engines behind each router in turn. "
             "Headers = the router's response headers (it has handed the request to an engine); by send order = the "
             f"requests in eighths by when the client sent them. Machine: {out['machine']}.", "",
             "| router | round | ok | send spread ms | headers p10 / p50 / p90 ms | TTFT p10 / p50 / p90 ms | "
             "headers p50 by send order ms | TTFT p50 by send order ms |", "|---|---|---|---|---|---|---|---|"]
    for label, rs in out["runs"].items():
        for i, s in enumerate(rs):
            h, t = s["headers_ms"], s["ttft_ms"]
            lines.append(f"| {label} | {i} | {s['ok']}/{s['requests']} | {s['send_spread_ms']} | {h['p10']} / {h['p50']} / {h['p90']} | "
                         f"{t['p10']} / {t['p50']} / {t['p90']} | {', '.join(map(str, s['headers_p50_by_send_order_ms']))} | "
                         f"{', '.join(map(str, s['ttft_p50_by_send_order_ms']))} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "burst_headers.json").write_text(json.dumps(out, indent=2))
    (RESULTS / "burst_headers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--routers", default="kvyard-kv,vllm-router-rr")
    ap.add_argument("--baseline", default=None, help="another kvyard checkout, run as kvyard-baseline-*")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--speedup", type=float, default=0.1, help="sim engine speed-up (routers_compare's c256 level)")
    ap.add_argument("--isl", type=int, default=64)
    ap.add_argument("--osl", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    write(asyncio.run(amain(ap.parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
