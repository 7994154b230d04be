"""Sim fidelity: does the running sim reproduce its profile's TTFT and ITL? (no assertions; a report)

    .venv/bin/python benchmarks/sim_fidelity.py [--profile h200-llama3.1-8b] [--speedups 1 10] [--quick]

For each speed-up the sim is launched as kvyard launches it (EngineProcess + SimBackend) and measured:

1. TTFT vs ISL: one request at a time at each ISL the profile measured, a prompt of fresh random token
   ids (no prefix reuse), `max_tokens=1`, 3 repetitions, median. Client TTFT = send -> first SSE event
   (raw asyncio client); engine TTFT = the request's `vllm:time_to_first_token_seconds` (histogram delta).
   Both are multiplied by the speed-up and compared with the profile's measured TTFT at that ISL.
2. ITL vs batch size: B concurrent streams whose context sits on one of the profile's decode rows
   (prompt = row context - 16). Once every stream has its first token and `SETTLE_TOKENS` more (the
   loop absorbs the burst of B arrivals by catching up), a window of `--window-tokens`
   tokens per stream is measured: client ITL = time per token seen by the client (chunks carry
   continuous usage), engine ITL = `vllm:inter_token_latency_seconds` delta. Batches are limited to
   B * speed-up <= `--max-rate` (the sim, the client and everything else share this machine's CPUs). Prediction = the profile interpolated (the sim's TimingModel) at the window's actual state:
   B sequences at their measured mean context; the nearest measured profile point is listed too.
   Each point is run `--itl-reps` times and the median (by engine ITL) is reported; all runs are in the JSON.

Writes benchmarks/results/sim_fidelity.json, .md and .png (if matplotlib is installed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from workers.process import EngineProcess  # noqa: E402
from workers.sim.backend import SimBackend  # noqa: E402
from workers.sim.profiles import load_profile  # noqa: E402
from workers.sim.timing import TimingModel, interp  # noqa: E402
from workers.types import EngineLaunchConfig  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
MODEL = "sim"
MAX_MODEL_LEN = 16400
SETTLE_TOKENS = 20  # decode steps skipped after the last first token (the burst of arrivals is absorbed)
VOCAB = 100000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RawStream:
    """Minimal HTTP/1.1 streaming POST: when each SSE event arrives and how many tokens it brings.

    Requests `continuous_usage_stats`, so every chunk carries the running `completion_tokens`; under load
    the sim (like vLLM) may put several tokens in one chunk, and ITL is time per token, not per chunk.
    """

    _TOKENS = re.compile(rb'"completion_tokens":(\d+)')

    def __init__(self, port: int, body: dict) -> None:
        body = {**body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        payload = json.dumps(body).encode()
        self.request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        ).encode() + payload
        self.port = port
        self.sent = 0.0
        self.events: list[tuple[float, int]] = []  # (arrival time, completion tokens so far)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            self.sent = time.perf_counter()
            writer.write(self.request)
            await writer.drain()
            buf = b""
            while True:
                data = await reader.read(65536)
                now = time.perf_counter()
                if not data:
                    return
                buf += data
                *done, buf = buf.split(b"\n\n")
                for ev in done:
                    m = self._TOKENS.search(ev)
                    if m and b'"choices":[]' not in ev:
                        self.events.append((now, int(m.group(1))))
                    elif ev.endswith(b"[DONE]"):
                        return
                if stop is not None and stop.is_set():
                    return
        finally:
            writer.close()


def histogram(text: str, name: str) -> tuple[float, float]:
    s = c = 0.0
    for line in text.splitlines():
        if line.startswith(f"vllm:{name}_sum"):
            s = float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"vllm:{name}_count"):
            c = float(line.rsplit(" ", 1)[1])
    return s, c


async def scrape(url: str, name: str) -> tuple[float, float]:
    async with httpx.AsyncClient() as c:
        return histogram((await c.get(url + "/metrics")).text, name)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


async def ttft_sweep(url: str, port: int, isls: list[int], speedup: float, reps: int, rng: random.Random) -> list[dict]:
    rows = []
    for isl in isls:
        client, engine = [], []
        for _ in range(reps):
            before = await scrape(url, "time_to_first_token_seconds")
            s = RawStream(port, {"model": MODEL, "prompt": prompt(rng, isl), "max_tokens": 1})
            await s.run()
            after = await scrape(url, "time_to_first_token_seconds")
            client.append((s.events[0][0] - s.sent) * speedup * 1000)
            engine.append((after[0] - before[0]) * speedup * 1000)
        rows.append({"isl": isl, "client_ms": statistics.median(client), "engine_ms": statistics.median(engine)})
    return rows


async def itl_point(url: str, port: int, batch: int, ctx: int, speedup: float, rng: random.Random, window_tokens: int) -> dict:
    stop = asyncio.Event()
    plen = ctx - 16
    streams = [RawStream(port, {"model": MODEL, "prompt": prompt(rng, plen), "max_tokens": 4000}) for _ in range(batch)]
    tasks = [asyncio.create_task(s.run(stop)) for s in streams]
    while not all(s.events for s in streams):  # wait until every stream decodes
        await asyncio.sleep(0.005)
    settle = [s.events[-1][1] for s in streams]  # then skip SETTLE_TOKENS while the loop catches up
    while min(s.events[-1][1] - k for s, k in zip(streams, settle)) < SETTLE_TOKENS:
        await asyncio.sleep(0.002)
    m0 = await scrape(url, "inter_token_latency_seconds")
    starts = [s.events[-1] for s in streams]
    while min(s.events[-1][1] - e[1] for s, e in zip(streams, starts)) < window_tokens:
        await asyncio.sleep(0.002)
    m1 = await scrape(url, "inter_token_latency_seconds")
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    per_token, contexts = [], []
    for s, (t0, k0) in zip(streams, starts):
        t1, k1 = s.events[-1]
        per_token.append((t1 - t0) / max(1, k1 - k0))
        contexts.append(plen + (k0 + k1) / 2)
    await asyncio.sleep(0.5)  # let the aborts land before the next point
    return {
        "batch": batch, "mean_context": statistics.mean(contexts),
        "client_ms": statistics.mean(per_token) * speedup * 1000,
        "engine_ms": (m1[0] - m0[0]) / max(1.0, m1[1] - m0[1]) * speedup * 1000,
        "tokens_per_chunk": statistics.mean((s.events[-1][1] - e[1]) / max(1, sum(1 for ev in s.events if ev[0] > e[0])) for s, e in zip(streams, starts)),
    }  # fmt: skip


def run_speedup(profile_name: str, speedup: float, isls: list[int], batches: list[int], ctx: int, reps: int,
                window_tokens: int, itl_reps: int = 3) -> dict:
    """Launch one sim at `speedup`, run both sweeps against it, stop it."""
    work = Path(tempfile.mkdtemp(prefix="kvy-fid-"))
    cfg = EngineLaunchConfig(
        model=profile_name, served_model_name=MODEL, port=free_port(), block_size=16, max_model_len=MAX_MODEL_LEN,
        max_num_seqs=256, max_num_batched_tokens=8192, extra_args=["--speedup", str(speedup)],
    )  # fmt: skip
    proc = EngineProcess(SimBackend(), cfg, log_path=work / "sim.log")
    proc.start()
    try:
        asyncio.run(proc.wait_healthy(60))
        rng = random.Random(1234)

        async def main() -> dict:
            ttft = await ttft_sweep(proc.url, cfg.port, isls, speedup, reps, rng)
            itl = []
            for b in batches:  # median of `itl_reps` runs: the box is shared, one run may hit a CPU burst
                runs = [await itl_point(proc.url, cfg.port, b, ctx, speedup, rng, window_tokens) for _ in range(itl_reps)]
                med = sorted(runs, key=lambda r: r["engine_ms"])[len(runs) // 2]
                itl.append({**med, "runs": [{k: round(v, 3) for k, v in r.items()} for r in runs]})
            return {"speedup": speedup, "ttft": ttft, "itl": itl}

        return asyncio.run(main())
    finally:
        asyncio.run(proc.stop())
        shutil.rmtree(work, ignore_errors=True)


def annotate(result: dict, model: TimingModel) -> None:
    p = model.profile
    isl, ttft = list(p.prefill_isl), list(p.prefill_ttft_ms)
    for r in result["ttft"]:
        r["profile_ms"] = interp(r["isl"], isl, ttft)
        r["client_err"] = r["client_ms"] / r["profile_ms"] - 1
        r["engine_err"] = r["engine_ms"] / r["profile_ms"] - 1
    for r in result["itl"]:
        u = r["batch"] * r["mean_context"] / model.max_kv_tokens
        r["kv_usage"] = u
        r["profile_ms"] = model.itl_ms(u, r["mean_context"])
        row = min(set(p.decode_context.tolist()), key=lambda c: abs(c - r["mean_context"]))  # closest context row,
        j = min((k for k in range(len(p.decode_itl_ms)) if p.decode_context[k] == row), key=lambda k: abs(p.decode_kv_usage[k] - u))
        r["nearest_point"] = {"kv_usage": float(p.decode_kv_usage[j]), "context": float(p.decode_context[j]), "itl_ms": float(p.decode_itl_ms[j])}
        r["client_err"] = r["client_ms"] / r["profile_ms"] - 1
        r["engine_err"] = r["engine_ms"] / r["profile_ms"] - 1


def markdown(report: dict) -> str:
    out = [f"# Sim fidelity: {report['profile']}", "",
           f"Measured {report['date']} on {report['machine']}. Times are scaled back to profile time (measured x speed-up).",
           "Error = measured / profile - 1. Client = raw HTTP client (includes HTTP overhead x speed-up); engine = the sim's own",
           "`vllm:` histograms. Target: |error| <= 10%.", ""]  # fmt: skip
    for res in report["runs"]:
        s = res["speedup"]
        out += [f"## speed-up {s:g}", "", "### TTFT vs ISL (single requests, no prefix reuse)", "",
                "| ISL | profile ms | engine ms | engine err | client ms | client err |", "|---:|---:|---:|---:|---:|---:|"]
        for r in res["ttft"]:
            out.append(f"| {r['isl']} | {r['profile_ms']:.1f} | {r['engine_ms']:.1f} | {r['engine_err']:+.1%} | {r['client_ms']:.1f} | {r['client_err']:+.1%} |")
        out += ["", f"### ITL vs batch size (context on the profile row ~{report['itl_context']})", "",
                "| B | mean ctx | KV usage | profile ms | nearest point (u, ctx, ms) | engine ms | engine err | client ms | client err | tokens/chunk |",
                "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
        for r in res["itl"]:
            n = r["nearest_point"]
            out.append(f"| {r['batch']} | {r['mean_context']:.0f} | {r['kv_usage']:.3f} | {r['profile_ms']:.2f} | "
                       f"({n['kv_usage']:.3f}, {n['context']:.0f}, {n['itl_ms']:.2f}) | {r['engine_ms']:.2f} | {r['engine_err']:+.1%} | "
                       f"{r['client_ms']:.2f} | {r['client_err']:+.1%} | {r['tokens_per_chunk']:.1f} |")
        out.append("")
    out += [
        "## Reading this", "",
        "- *engine* columns are the sim's own step clock (its `vllm:` histograms): that is the timing model at work.",
        "- *client* columns add what the HTTP round trip costs on this shared 2-core box (~1 ms wall), which a speed-up",
        "  multiplies in profile time: at x10 short prompts show +20-40% client TTFT although the engine is on target.",
        "  Request processing before the engine (parsing, tokenizing, hashing) is *not* added: the profile's TTFT was",
        "  itself measured by a client against vLLM, so the sim counts from the request's arrival.",
        "- ITL is per token (continuous usage in every chunk). When the sim falls behind (B x speed-up too large for the",
        "  CPU) it keeps the engine clock and coalesces tokens into fewer chunks, like vLLM's API server under load",
        "  (`tokens/chunk` > 1); keep B x speed-up x 1000/ITL well below ~30k tokens/s per core.",
        "- The box is shared with other jobs: when one of them takes a core, the points that need most CPU (x10 with",
        "  B >= 32, ~10k tokens/s through HTTP) slow down and the sim logs that it dropped profile time; the JSON keeps",
        "  every run. On a quiet box those points land within 2% (see git history of this file).",
        "",
    ]
    return "\n".join(out)


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    first = report["runs"][0]
    a.plot([r["isl"] for r in first["ttft"]], [r["profile_ms"] for r in first["ttft"]], "k-o", label="profile")
    b.plot([r["batch"] for r in first["itl"]], [r["profile_ms"] for r in first["itl"]], "k-o", label="profile (interpolated)")
    for res in report["runs"]:
        s = res["speedup"]
        a.plot([r["isl"] for r in res["ttft"]], [r["engine_ms"] for r in res["ttft"]], "x--", label=f"sim engine, x{s:g}")
        a.plot([r["isl"] for r in res["ttft"]], [r["client_ms"] for r in res["ttft"]], ".:", label=f"sim client, x{s:g}")
        b.plot([r["batch"] for r in res["itl"]], [r["engine_ms"] for r in res["itl"]], "x--", label=f"sim engine, x{s:g}")
        b.plot([r["batch"] for r in res["itl"]], [r["client_ms"] for r in res["itl"]], ".:", label=f"sim client, x{s:g}")
    a.set(xlabel="ISL (tokens)", ylabel="TTFT (profile ms)", title="TTFT vs ISL")
    b.set(xlabel="concurrent decodes B", ylabel="ITL (profile ms)", title=f"ITL vs B at context ~{report['itl_context']}")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.suptitle(f"kvyard sim fidelity: {report['profile']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="h200-llama3.1-8b")
    ap.add_argument("--speedups", type=float, nargs="+", default=[1.0, 10.0])
    ap.add_argument("--reps", type=int, default=3, help="TTFT repetitions per ISL (median)")
    ap.add_argument("--itl-reps", type=int, default=3, help="ITL runs per batch size (median by engine ITL)")
    ap.add_argument("--window-tokens", type=int, default=60)
    ap.add_argument("--max-rate", type=float, default=600.0, help="largest B x speed-up measured")
    ap.add_argument("--quick", action="store_true", help="fewer points (smoke run)")
    ap.add_argument("--render-only", action="store_true", help="re-render .md/.png from the existing .json")
    args = ap.parse_args()
    if args.render_only:
        report = json.loads((RESULTS / "sim_fidelity.json").read_text())
        (RESULTS / "sim_fidelity.md").write_text(markdown(report) + "\n")
        plot(report, RESULTS / "sim_fidelity.png")
        return
    model = TimingModel(load_profile(args.profile))
    p = model.profile
    isls = [int(v) for v in p.prefill_isl]
    rows = sorted(set(float(c) for c in p.decode_context))
    ctx = int(rows[1] if len(rows) > 1 else rows[0])
    on_row = sorted({round(float(u) * model.max_kv_tokens / ctx) for u, c in zip(p.decode_kv_usage, p.decode_context) if c == ctx})
    batches = sorted({b for b in on_row if b <= 256} | {8, 16, 32})
    if args.quick:
        isls, batches = isls[::4], batches[:3]
    report = {
        "profile": args.profile, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f} at start), Python {sys.version.split()[0]}", "itl_context": ctx, "runs": [],
    }  # fmt: skip
    for s in args.speedups:
        bs = [b for b in batches if b * s <= args.max_rate]
        res = run_speedup(args.profile, s, isls, bs, ctx, args.reps, args.window_tokens, args.itl_reps)
        annotate(res, model)
        report["runs"].append(res)
        print(f"speed-up {s:g} done", flush=True)
    report["machine"] += f"; load average {os.getloadavg()[0]:.1f} at the end (the box is shared)"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sim_fidelity.json").write_text(json.dumps(report, indent=1))
    md = markdown(report)
    (RESULTS / "sim_fidelity.md").write_text(md + "\n")
    plot(report, RESULTS / "sim_fidelity.png")
    print(md)


if __name__ == "__main__":
    main()
