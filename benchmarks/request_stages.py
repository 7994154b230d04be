"""Where a request's time goes in the frontend before the engine has it: timestamps by stage, at concurrency 1.

    PYTHONPATH=. .venv/bin/python benchmarks/request_stages.py [--requests 300] [--speedups 2,200] [--baseline DIR] [--rounds 3]

One sim engine (KV events on) and one frontend of this tree, started through this script's own launcher
(`--launch`), which wraps a few of the frontend's functions to stamp, for each request, the time since its first
byte reached the HTTP parser (on_message_begin) at their entry (`>`) and exit (`<`), through the engine write
(`_Conn.send`) and the engine's answer, up to the first write to the client that carries a content chunk
(`DirectBody.write`: what the client's TTFT waits for). A client sends chat requests (64-token prompts, 16 output tokens) one at a time, alternating
between the frontend and the engine itself, so the TTFT the frontend adds is read beside the stages. Each speed-up
of the sim is one run: at 2 the engine takes ~10 ms to its first token and the frontend's code runs with caches
cold from the engine and the client that share the machine's cores; at 200 requests come back to back (warm).
With --baseline, a frontend of the tree at DIR (e.g. `git archive <rev> | tar -x -C DIR`, C extensions copied in)
runs the same way beside this tree's at each speed-up, the order alternating over --rounds. The wrappers cost a few microseconds a stage. Reported: the median of each stamp over the requests (the first 25
dropped) and TTFT p50 both ways. Writes benchmarks/results/<--out>.{json,md} (default request_stages).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
REDIS = "redis://127.0.0.1:6379"
# (module, attribute path, label): what is stamped, in the order a request passes it
STAGES = (
    ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle.run_asgi", "asgi task"),
    ("orchestrator.service", "InferenceService.handle", "handler"),
    ("orchestrator.service", "InferenceService.dispatch", "dispatch"),
    ("orchestrator.service", "parse_request", "parse"),
    ("orchestrator.prepare", "PromptPreparer.prompt_ids", "prompt ids"),
    ("orchestrator.tokenizer", "PromptTokenizer.render_chat", "chat template"),
    ("orchestrator.tokenizer", "PromptTokenizer.count_or_ids", "tokenize"),
    ("orchestrator.resilience.admission", "AdmissionController.admit", "admission"),
    ("router.router", "Router.route", "route"),
    ("orchestrator.service", "InferenceService.send_ranked", "send"),
    ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle.send", "asgi send"),
)


def launch(out: str, argv: list[str]) -> None:
    """The frontend, its stages stamped; the stamps so far are written to `out` (JSON) on SIGUSR1."""
    import functools
    import importlib
    import inspect

    pc = time.perf_counter
    cur: dict = {"t0": None, "marks": []}
    done: list = []

    def mark(label: str) -> None:
        if cur["t0"] is not None:
            cur["marks"].append((label, round((pc() - cur["t0"]) * 1e6)))

    def wrap(owner, name: str, label: str) -> None:
        f = getattr(owner, name)
        if inspect.iscoroutinefunction(f):
            async def w(*a, **k):
                mark(label + " >")
                r = await f(*a, **k)
                mark(label + " <")
                return r
        else:
            def w(*a, **k):
                mark(label + " >")
                r = f(*a, **k)
                mark(label + " <")
                return r
        setattr(owner, name, functools.wraps(f)(w))

    for module, path, label in STAGES:
        owner = importlib.import_module(module)
        *parents, name = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        wrap(owner, name, label)
    from orchestrator import engine_client
    from orchestrator.security import connections

    make = connections.guarded_protocol

    def guarded_protocol(*a, **k):
        cls = make(*a, **k)
        begin = cls.on_message_begin

        def on_message_begin(self):
            cur["t0"], cur["marks"] = pc(), []
            return begin(self)
        cls.on_message_begin = on_message_begin
        wrap(cls, "on_headers_complete", "headers parsed")
        wrap(cls, "on_message_complete", "body parsed")
        return cls
    connections.guarded_protocol = guarded_protocol
    send = engine_client._Conn.send

    def conn_send(self, head, body, *a, **k):
        if cur["t0"] is not None and body:
            mark("engine write")
        return send(self, head, body, *a, **k)
    engine_client._Conn.send = conn_send
    # the way back: the engine's answer, then the first write to the client that carries content (the client's TTFT)
    wrap(engine_client._Conn, "on_headers_complete", "engine headers")
    wrap(engine_client._Conn, "on_body", "engine body")
    from orchestrator import direct_body

    def stamped(write):
        def body_write(*a):
            r = write(*a)
            data = a[-1]
            if cur["t0"] is not None:
                mark("client write")
                if b'"content"' in data:
                    mark("content to client")
                    done.append(cur["marks"])
                    cur["t0"] = None
            return r
        return body_write
    direct_body.DirectBody.write = stamped(direct_body.DirectBody.write)
    writer = direct_body.DirectBody.writer
    if direct_body.ChunkWriter is not None:  # the token path's writer is C: stamp around it (else it is write)
        direct_body.DirectBody.writer = lambda self: stamped(writer(self))

    def dump(*_) -> None:
        tmp = Path(out + ".part")
        tmp.write_text(json.dumps(done))
        tmp.rename(out)

    signal.signal(signal.SIGUSR1, dump)  # the benchmark asks for the stamps before it stops the frontend
    sys.argv = ["kvyard", *argv]
    from orchestrator.cli import main
    main()


async def run(speedup: float, requests: int, tmp: Path, tree: Path = ROOT) -> dict:
    import aiohttp

    from benchmarks.frontend_cpu import start_sims, stop_sims, text
    from benchmarks.frontend_overhead import wait_http
    from orchestrator.testing import free_port

    prefix = f"stages{os.getpid()}x{int(speedup)}"
    engines, disc = await start_sims(tmp, prefix, REDIS, speedup, n=1)
    port, stamps = free_port(), tmp / f"stamps-{speedup:g}-{abs(hash(str(tree)))}.json"
    fe = subprocess.Popen([sys.executable, __file__, "--launch", str(stamps), "--", "--log-level", "warning", "frontend",
                           "--port", str(port), "--grpc-port", "0", "--redis-url", REDIS, "--discovery-prefix", prefix],
                          stdout=subprocess.DEVNULL, stderr=open(tmp / "frontend.log", "wb"), cwd=str(tree),
                          env={**os.environ, "PYTHONPATH": str(tree)})
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(3)
    ttft: dict[str, list[float]] = {"frontend": [], "engine": []}
    try:
        await wait_http(url + "/health", 90)
        async with aiohttp.ClientSession() as s:
            async def one(base: str) -> float | None:
                body = {"model": "sim", "messages": [{"role": "user", "content": text(rng, 64)}], "max_tokens": 16,
                        "stream": True, "ignore_eos": True}
                t0, first = time.perf_counter(), None
                async with s.post(base + "/v1/chat/completions", json=body) as r:
                    r.raise_for_status()
                    async for line in r.content:
                        if first is None and line.startswith(b"data:") and b'"content"' in line:
                            first = time.perf_counter() - t0
                return first

            for _ in range(120):  # until the frontend knows the engine
                try:
                    await one(url)
                    break
                except aiohttp.ClientResponseError:
                    await asyncio.sleep(0.5)
            for _ in range(requests):
                for name, base in (("frontend", url), ("engine", engines[0].url)):
                    t = await one(base)
                    if t is not None:
                        ttft[name].append(t * 1e3)
        fe.send_signal(signal.SIGUSR1)
        for _ in range(100):
            if stamps.exists():
                break
            await asyncio.sleep(0.1)
    finally:
        await stop_sims(engines, disc, {"frontend": fe})
    runs = json.loads(stamps.read_text())[25:] if stamps.exists() else []
    by_label: dict[str, list[int]] = {}
    for marks in runs:
        seen = set()
        for label, us in marks:
            if label not in seen:  # a stage's first pass (render and tokenize may run twice for other shapes)
                seen.add(label)
                by_label.setdefault(label, []).append(us)
    # a stamp most requests never reach before their content write (the exit of the engine read that makes it) is
    # left out: its median would be of a few odd requests
    stages = sorted(((label, statistics.median(v), len(v)) for label, v in by_label.items() if 2 * len(v) >= len(runs)),
                    key=lambda x: x[1])
    fe_p50, en_p50 = statistics.median(ttft["frontend"]), statistics.median(ttft["engine"])
    return {"speedup": speedup, "requests": len(runs), "ttft_p50_ms": {"frontend": round(fe_p50, 3), "engine": round(en_p50, 3),
            "added": round(fe_p50 - en_p50, 3)}, "stages_us_p50": [{"stamp": lb, "us": round(us), "n": n} for lb, us, n in stages]}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--launch":
        sys.path.remove(str(ROOT))  # the one inserted above: the frontend's tree comes from PYTHONPATH
        launch(sys.argv[2], sys.argv[4:] if sys.argv[3] == "--" else sys.argv[3:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--speedups", default="2,200")
    ap.add_argument("--baseline", type=Path, default=None, help="a checkout of another tree, run beside this one")
    ap.add_argument("--rounds", type=int, default=1, help="rounds; the trees' order alternates from round to round")
    ap.add_argument("--out", default="request_stages")
    args = ap.parse_args()
    from benchmarks.common import result_header

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = [("new", ROOT)] + ([("base", args.baseline.resolve())] if args.baseline else [])
        for rnd in range(args.rounds):
            for sp in (float(x) for x in args.speedups.split(",")):
                for name, tree in (trees if rnd % 2 == 0 else trees[::-1]):
                    r = {"tree": name, "round": rnd, **asyncio.run(run(sp, args.requests, Path(tmp), tree))}
                    results.append(r)
                    print(json.dumps(r), flush=True)
    cmd = f"benchmarks/request_stages.py --requests {args.requests} --speedups {args.speedups}" + (
        f" --baseline {args.baseline}" if args.baseline else "") + (f" --rounds {args.rounds}" if args.rounds > 1 else "")
    out = {**result_header("request_stages"), "command": cmd, "runs": results}
    out["loadavg"]["end"] = round(os.getloadavg()[0], 2)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(out, indent=1))
    columns = [(name, float(sp)) for sp in args.speedups.split(",") for name, _ in trees]

    def cell(name: str, sp: float, pick) -> list[float]:  # one value per round
        return [v for r in results if r["tree"] == name and r["speedup"] == sp and (v := pick(r)) is not None]

    def stamp(lb: str):
        return lambda r: next((s["us"] for s in r["stages_us_p50"] if s["stamp"] == lb), None)

    def fmt(vals: list[float], spec: str) -> str:
        if not vals:
            return "–"
        mid = format(statistics.median(vals), spec)
        return mid if len(vals) == 1 else f"{mid} ({' / '.join(format(v, spec) for v in vals)})"

    lines = [f"`{cmd}`: one sim engine, a frontend of each tree in turn with its stages stamped, concurrency 1, 64-token chat "
             f"prompts, 16 output tokens. Microseconds since the request's first byte reached the HTTP parser, median "
             f"over the requests; `>` a stage's entry, `<` its exit; new = this tree"
             + (f", base = {args.baseline}" if args.baseline else "") + ". With several rounds: their median, then each "
             f"round's. Machine: {out['machine']}, load {out['loadavg']}.", ""]
    labels = [s["stamp"] for s in results[0]["stages_us_p50"]]
    lines.append("| stamp | " + " | ".join(f"{name}, sim speed-up {sp:g}" for name, sp in columns) + " |")
    lines.append("|---|" + "---|" * len(columns))
    for lb in labels:
        lines.append(f"| {lb} | " + " | ".join(fmt(cell(n, sp, stamp(lb)), ",.0f") for n, sp in columns) + " |")
    for what, key in (("TTFT p50 through the frontend, ms", "frontend"), ("TTFT p50 at the engine itself, ms", "engine"),
                      ("TTFT added, ms", "added")):
        lines.append(f"| {what} | " + " | ".join(fmt(cell(n, sp, lambda r: r["ttft_p50_ms"][key]), ".2f") for n, sp in columns) + " |")
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
