"""Frontend CPU: the CPU-seconds a kvyard frontend process spends per request and per streamed token, A/B in one run.

Two sim engines are registered in Redis; frontend "new" runs this tree, and with `--baseline DIR` frontend "base"
runs the code of DIR (e.g. `git archive 7811bfd | tar -x -C DIR`, with router/_kvcore*.so copied in), both on the
same engines, driven in turn (rotated order per round) by the same light aiohttp client. The frontend's CPU is read
from /proc/<pid>/stat (utime + stime: all its threads) around each run. Workloads:

  long    multi-turn chat with ~20k-token prompts: `--conversations` conversations share a ~4k-token system prompt,
          each opens with its own ~14k-token document, then every turn re-sends the history plus one more
          user/assistant exchange (as chat clients do); closed loop, one stream per conversation, 8 output tokens.
          Reported: frontend CPU-ms per request.
  stream  64-token prompts, 512 output tokens (ignore_eos), at each of `--stream-concurrency`. Reported: frontend
          CPU-seconds per 1,000 streamed tokens, and SSE events per token (equal chunking is what makes the
          frontends comparable).
  short   64-token prompts, 2 output tokens, closed loop at --short-concurrency (32): what a request costs apart
          from its token stream (HTTP, JSON, validation, tokenizing, routing, the engine call, metrics). Reported:
          frontend CPU-ms per request.
  ttft1   concurrency 1, 64-token prompts, 16 output tokens: TTFT p50 straight at the engine and through each
          frontend; the difference is the TTFT the frontend adds.

    PYTHONPATH=. .venv/bin/python benchmarks/frontend_cpu.py --baseline /tmp/base22 [--rounds 2]
    ... --only new --pyspy /tmp/prof      # py-spy record (raw collapsed stacks) of the new frontend per workload

Needs Redis on 127.0.0.1:6379. Writes benchmarks/results/<--out>.{json,md} (default frontend_cpu; not with --pyspy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.frontend_overhead import cpu_seconds, wait_http  # noqa: E402
from orchestrator.testing import free_port  # noqa: E402
from workers.discovery import RedisDiscovery  # noqa: E402
from workers.process import EngineProcess  # noqa: E402
from workers.registry import get_backend  # noqa: E402
from workers.sim.backend import SIM_TOKENIZER_DIR  # noqa: E402
from workers.types import EngineLaunchConfig, WorkerInfo  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CTX = 32768
_WORDS = ("the of and to in is was for on that with as by at from his her this which or an be are were had have not "
          "but all they one there been their more when who will would can said if into time has only other new some "
          "could these two may first then do any like my now over such our man me even most made after also did many "
          "before must through back years where much your way well down should because each just those people how too "
          "little state good very make world still own see men work long get here between both life being under never "
          "day same another know while last might us great old year off come since against go came right used take "
          "three states himself few house use during without again place around however home small found thought went "
          "say part once general high upon school every does got united left number course war until always away "
          "something fact though water less public put think almost hand enough far took head yet government system "
          "kernel cache router engine prefix token stream latency throughput batch decode prefill scheduler").split()


def text(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of word salad (cl100k: ~1.1 tokens per word here), with commas and a line break about
    every 60 words (prose as chat clients send it: a newline between sentences, no space around it)."""
    out = []
    for i in range(int(tokens / 1.15)):
        sep = "" if i == 0 else ".\n" if i % 61 == 0 else ", " if i % 13 == 0 else " "
        out.append(sep + rng.choice(_WORDS))
    return "".join(out)


async def start_sims(tmp: Path, prefix: str, redis_url: str, speedup: float, extra: list[str] = (), n: int = 2):
    """`n` sim engines (KV events on) registered under `prefix` in Redis: (engines, discovery)."""
    engines = []
    for i in range(n):
        e = EngineProcess(get_backend("sim"), EngineLaunchConfig(
            model="h200-llama3.1-8b", served_model_name="sim", port=free_port(), block_size=16, max_model_len=CTX,
            max_num_batched_tokens=CTX, kv_events_endpoint=f"ipc://{tmp}/kv{i}.sock", kv_replay_endpoint=f"ipc://{tmp}/replay{i}.sock",
            extra_args=["--speedup", str(speedup), "--num-gpu-blocks", "40000", *extra]), tmp / f"engine{i}.log")
        e.start()
        engines.append(e)
    for e in engines:
        await e.wait_healthy(90)
    disc = RedisDiscovery(redis_url, prefix=prefix)
    for i, e in enumerate(engines):
        await disc.register(WorkerInfo(worker_id=f"sim-{i}", model="sim", backend="sim", url=e.url, block_size=16, max_model_len=CTX,
                                       tokenizer=str(SIM_TOKENIZER_DIR), kv_events_endpoint=f"ipc://{tmp}/kv{i}.sock",
                                       kv_replay_endpoint=f"ipc://{tmp}/replay{i}.sock", kv_events_topic="kv-events"), ttl_s=3600)
    return engines, disc


async def stop_sims(engines: list, disc, frontends: dict | None = None) -> None:
    """Stop the frontend processes (if given), then deregister and stop the engines."""
    for proc in (frontends or {}).values():
        proc.terminate()
        proc.wait(10)
    for i in range(len(engines)):
        await disc.deregister(f"sim-{i}")
    await disc.close()
    for e in engines:
        await e.stop()


def frontend(port: int, redis_url: str, prefix: str, log: Path, tree: Path, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen([sys.executable, "-m", "orchestrator", "--log-level", "warning", "frontend", "--port", str(port),
                             "--grpc-port", "0", "--redis-url", redis_url, "--discovery-prefix", prefix, *extra],
                            stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env=env, cwd=str(tree))


async def one(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """POST a streaming request; TTFT, content events and the usage's token counts."""
    t0 = time.perf_counter()
    ttft, events, usage, buf = None, 0, {}, b""
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            return {"ok": False, "error": f"HTTP {resp.status}: {(await resp.read())[:200]!r}"}
        async for chunk in resp.content.iter_any():
            buf += chunk
            *evs, buf = buf.split(b"\n\n")
            for ev in evs:
                if not ev.startswith(b"data: {"):
                    continue
                if b'"choices":[]' in ev and b'"usage"' in ev:
                    usage = json.loads(ev[6:])["usage"]
                    continue
                events += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    return {"ok": ttft is not None, "ttft_s": ttft, "events": events, "completion_tokens": usage.get("completion_tokens", 0),
            "prompt_tokens": usage.get("prompt_tokens", 0), "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def p50(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


async def closed_loop(base: str, conc: int, bodies: list[tuple[str, dict]]) -> tuple[list[dict], float]:
    it = iter(bodies)
    out: list[dict] = []
    conn = aiohttp.TCPConnector(limit=conc + 8)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=900)) as s:
        async def worker() -> None:
            for path, body in it:
                out.append(await one(s, base + path, body))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        return out, time.perf_counter() - t0


async def long_run(base: str, conversations: int, turns: int, seed: int) -> tuple[list[dict], float]:
    """One stream per conversation; each conversation's turns in order (the history grows by one exchange a turn)."""
    rng = random.Random(seed)
    system = text(random.Random(7), 4000)
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": text(rng, 14000) + "\nSummarise the above."}]
             for _ in range(conversations)]
    out: list[dict] = []
    conn = aiohttp.TCPConnector(limit=conversations + 8)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=900)) as s:
        async def talk(msgs: list[dict], r: random.Random) -> None:
            for _ in range(turns):
                body = {"model": "sim", "messages": msgs, "max_tokens": 8, "stream": True,
                        "stream_options": {"include_usage": True}, "ignore_eos": True}
                out.append(await one(s, base + "/v1/chat/completions", body))
                msgs = msgs + [{"role": "assistant", "content": text(r, 150)}, {"role": "user", "content": text(r, 300) + " Why?"}]
        t0 = time.perf_counter()
        await asyncio.gather(*(talk(c, random.Random(seed * 1000 + i)) for i, c in enumerate(convs)))
        return out, time.perf_counter() - t0


def short_bodies(n: int, max_tokens: int, seed: int) -> list[tuple[str, dict]]:
    rng = random.Random(seed)
    return [("/v1/completions", {"model": "sim", "prompt": text(rng, 64), "max_tokens": max_tokens, "stream": True,
                                 "stream_options": {"include_usage": True}, "ignore_eos": True}) for _ in range(n)]


class PySpy:
    """py-spy record (raw collapsed stacks) of one process while a block runs."""

    def __init__(self, exe: str | None, pid: int, out: Path | None, rate: int = 200) -> None:
        self.exe, self.pid, self.out, self.proc, self.rate = exe, pid, out, None, rate

    def __enter__(self):
        if self.exe:
            self.proc = subprocess.Popen([self.exe, "record", "--pid", str(self.pid), "--format", "raw", "--rate", str(self.rate),
                                          "--threads", "-o", str(self.out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.send_signal(2)
            self.proc.wait(30)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", type=Path, default=None)
    ap.add_argument("--only", choices=["new", "base"], default=None)
    ap.add_argument("--workloads", default="long,stream,ttft1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--stream-concurrency", default="64,256")
    ap.add_argument("--stream-requests", type=int, default=256, help="requests per stream run (at least the concurrency)")
    ap.add_argument("--ttft-requests", type=int, default=48)
    ap.add_argument("--short-concurrency", type=int, default=32)
    ap.add_argument("--short-requests", type=int, default=2000)
    ap.add_argument("--out", default="frontend_cpu", help="result file name under benchmarks/results/")
    ap.add_argument("--idle-s", type=float, default=10.0, help="seconds without load, to measure the frontend's own background CPU")
    ap.add_argument("--speedup", type=float, default=2.0, help="sim engine speed-up (paces decode; 1 = the profile's ITL)")
    ap.add_argument("--pyspy", type=Path, default=None, help="folder for py-spy raw profiles (uses $PYSPY or py-spy)")
    ap.add_argument("--pyspy-rate", type=int, default=200, help="py-spy samples a second")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--render", type=Path, default=None, help="only rewrite the .md from this frontend_cpu.json")
    args = ap.parse_args()
    if args.render:
        saved = json.loads(args.render.read_text())
        for k, v in saved["args"].items():
            setattr(args, k, Path(v) if k == "baseline" and v else v)
        args.render = None
        write_results(saved["rows"], args, saved["idle_cpu_ms_per_s"])
        return
    workloads = args.workloads.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="kvyard-fecpu-"))
    prefix = f"kvyard-bench-{uuid.uuid4().hex[:6]}"
    trees = {"new": Path(__file__).resolve().parent.parent}
    if args.baseline:
        trees["base"] = args.baseline.resolve()
    if args.only:
        trees = {args.only: trees[args.only]}
    engines, disc = await start_sims(tmp, prefix, args.redis_url, args.speedup, ["--enable-prompt-tokens-details"])
    ports = {k: free_port() for k in trees}
    procs = {k: frontend(ports[k], args.redis_url, prefix, tmp / f"frontend-{k}.log", trees[k]) for k in trees}
    spy = os.environ.get("PYSPY", "py-spy") if args.pyspy else None
    if args.pyspy:
        args.pyspy.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    try:
        for p in ports.values():
            await wait_http(f"http://127.0.0.1:{p}/health", 60)
        await asyncio.sleep(1.5)  # the pool's first refresh
        for k, p in ports.items():  # warm-up: tokenizer load, connections
            await closed_loop(f"http://127.0.0.1:{p}", 4, short_bodies(8, 16, 99))
        names = list(trees)
        idle0 = {k: cpu_seconds(procs[k].pid) for k in names}
        await asyncio.sleep(args.idle_s)  # no load: what the frontend spends on its own (scrapes, telemetry, events, timers)
        idle = {k: round((cpu_seconds(procs[k].pid) - idle0[k]) / args.idle_s * 1000, 2) for k in names}
        print(json.dumps({"idle_cpu_ms_per_s": idle}), flush=True)
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for wl in workloads:
                levels = [int(c) for c in args.stream_concurrency.split(",")] if wl == "stream" else [1 if wl == "ttft1" else args.short_concurrency if wl == "short" else args.conversations]
                for conc in levels:
                    row: dict = {"workload": wl, "concurrency": conc, "round": rnd, "order": order}
                    if wl == "ttft1":
                        direct, _ = await closed_loop(engines[0].url, 1, short_bodies(args.ttft_requests, 16, 5 + rnd))
                        row["direct_ttft_p50_ms"] = p50([r["ttft_s"] * 1000 for r in direct if r["ok"]])
                    for k in order:
                        seed = 100 * rnd + 10 * names.index(k)  # each frontend its own prompts: no run warms the engines' cache for the next
                        base = f"http://127.0.0.1:{ports[k]}"
                        cpu0 = cpu_seconds(procs[k].pid)
                        with PySpy(spy, procs[k].pid, args.pyspy / f"{wl}-c{conc}-{k}-r{rnd}.txt" if args.pyspy else None,
                                   args.pyspy_rate):
                            if wl == "long":
                                res, wall = await long_run(base, conc, args.turns, 11 + seed)
                            elif wl == "short":
                                res, wall = await closed_loop(base, conc, short_bodies(args.short_requests, 2, 7 + seed))
                            elif wl == "stream":
                                res, wall = await closed_loop(base, conc, short_bodies(max(conc, args.stream_requests), 512, 3 + seed))
                            else:
                                res, wall = await closed_loop(base, 1, short_bodies(args.ttft_requests, 16, 5 + seed))
                        cpu = cpu_seconds(procs[k].pid) - cpu0
                        ok = [r for r in res if r["ok"]]
                        toks = sum(r["completion_tokens"] for r in ok)
                        m = {"requests": len(res), "errors": len(res) - len(ok), "wall_s": round(wall, 2), "cpu_s": round(cpu, 3),
                             "cpu_ms_per_request": round(cpu * 1000 / max(1, len(ok)), 2),
                             "cpu_s_per_1k_tokens": round(cpu * 1000 / toks, 4) if toks else None,
                             "tokens_per_cpu_s": round(toks / cpu, 1) if cpu > 0 else None,
                             "events_per_token": round(sum(r["events"] for r in ok) / toks, 3) if toks else None,
                             "cpu_us_per_event": round(cpu * 1e6 / max(1, sum(r["events"] for r in ok)), 2),
                             "ttft_p50_ms": p50([r["ttft_s"] * 1000 for r in ok]),
                             "ttft_p90_ms": round(sorted(r["ttft_s"] * 1000 for r in ok)[int(0.9 * (len(ok) - 1))], 3) if ok else None,
                             "prompt_tokens_mean": round(statistics.mean(r["prompt_tokens"] for r in ok)) if ok else None,
                             "cache_hit": round(sum(r["cached_tokens"] for r in ok) / max(1, sum(r["prompt_tokens"] for r in ok)), 3)}
                        if wl == "ttft1" and row.get("direct_ttft_p50_ms") is not None and m["ttft_p50_ms"] is not None:
                            m["ttft_added_p50_ms"] = round(m["ttft_p50_ms"] - row["direct_ttft_p50_ms"], 3)
                        row[k] = m
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        await stop_sims(engines, disc, procs)
    if args.pyspy:
        return
    write_results(rows, args, idle)


def write_results(rows: list[dict], args, idle: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    names = [k for k in ("base", "new") if any(k in r for r in rows)]
    summary: dict = {}
    for r in rows:
        key = f"{r['workload']}@c{r['concurrency']}"
        s = summary.setdefault(key, {k: {"cpu_ms_per_request": [], "cpu_s_per_1k_tokens": [], "ttft_p50_ms": [], "ttft_added_p50_ms": [],
                                         "events_per_token": [], "cpu_us_per_event": [], "cache_hit": []} for k in names})
        for k in names:
            for f in s[k]:
                if r[k].get(f) is not None:
                    s[k][f].append(r[k][f])
    out = {"benchmark": "frontend_cpu", "machine": f"{os.cpu_count()} cores (shared)", "baseline": str(args.baseline) if args.baseline else None,
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "idle_cpu_ms_per_s": idle, "rows": rows, "summary": summary}
    (RESULTS / f"{args.out}.json").write_text(json.dumps(out, indent=2))

    def med(xs):
        return f"{statistics.median(xs):.3g}" if xs else "–"

    extra = (f" --workloads {args.workloads}" if args.workloads != "long,stream,ttft1" else "") + (
        f" --out {args.out}" if args.out != "frontend_cpu" else "") + (
        f" --ttft-requests {args.ttft_requests}" if args.ttft_requests != 48 else "")
    lines = [f"`benchmarks/frontend_cpu.py --baseline {args.baseline}{extra} --rounds {args.rounds} --speedup {args.speedup:g}`: two sim engines, "
             f"frontends `base` (the baseline tree) and `new` (this tree) on them in turn, {args.rounds} rounds in rotated order; "
             f"long = {args.conversations} multi-turn chats x {args.turns} turns (~19k-token prompts), stream = 64-token prompts x 512 "
             f"output tokens, short = 64-token prompts x 2 output tokens at concurrency {args.short_concurrency}, "
             f"ttft1 = concurrency 1, 16 output tokens. Frontend CPU from /proc (all threads); "
             f"medians over rounds (per-round values in the JSON). Machine: {os.cpu_count()} cores shared with other work.", "",
             "| workload | conc | " + " | ".join(f"{k}: CPU-ms/request | {k}: CPU-s/1k tokens | {k}: CPU-µs/event | {k}: events/token | {k}: TTFT p50 ms | {k}: cache hit"
                                                  for k in names) + " |",
             "|---|---|" + "---|---|---|---|---|---|" * len(names)]
    for key, s in summary.items():
        wl, conc = key.split("@c")
        lines.append(f"| {wl} | {conc} | " + " | ".join(
            f"{med(s[k]['cpu_ms_per_request'])} | {med(s[k]['cpu_s_per_1k_tokens'])} | {med(s[k]['cpu_us_per_event'])} | "
            f"{med(s[k]['events_per_token'])} | {med(s[k]['ttft_p50_ms'])} | {med(s[k]['cache_hit'])}"
            for k in names) + " |")
    if len(names) == 2:
        lines += ["", "new / base per round (the same round's two runs; min–max, median):", "",
                  "| workload | conc | CPU per request | CPU per event | TTFT p50 |", "|---|---|---|---|---|"]
        for key in summary:
            wl, conc = key.split("@c")
            rs = [r for r in rows if r["workload"] == wl and r["concurrency"] == int(conc)]

            def ratio(f):
                xs = sorted(r["new"][f] / r["base"][f] for r in rs if r["new"].get(f) and r["base"].get(f))
                return f"{xs[0]:.2f}–{xs[-1]:.2f} ({statistics.median(xs):.2f})" if xs else "–"
            lines.append(f"| {wl} | {conc} | {ratio('cpu_ms_per_request')} | {ratio('cpu_us_per_event')} | {ratio('ttft_p50_ms')} |")
    lines += ["", "Background CPU with no load (scrapes, telemetry, KV events, timers), CPU-ms per second: "
              + ", ".join(f"{k} {idle[k]}" for k in names) + " (included in every figure above)."]
    t1 = summary.get("ttft1@c1")
    if t1:
        lines += ["", "TTFT added at concurrency 1 (p50, frontend − direct, per round): " + "; ".join(
            f"{k} {', '.join(f'{x:.2f}' for x in t1[k]['ttft_added_p50_ms'])} ms" for k in names)]
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    asyncio.run(main())
