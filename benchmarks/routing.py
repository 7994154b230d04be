"""Routing benchmark: the Mooncake conversation trace and a shared-prefix workload, replayed open-loop
(fixed schedule, streaming) against `kvyard up --workers 8 --policy P` over sim engines, per policy.

    kvyard bench routing [--requests 500 --compression 8 --speedup 0.25 ...]
    .venv/bin/python benchmarks/routing.py [same flags]

Trace replay. The first `--requests` rows of benchmarks/data/mooncake_conversation_trace.jsonl. Each
hash id becomes a deterministic block of 512 token ids (a seeded RNG of the id), so two prompts have equal
tokens exactly where their hash ids are equal; the prompt is the blocks in order, cut to `input_length`,
sent as token ids to /v1/completions (`ignore_eos`, `max_tokens = ceil(output_length × --osl-scale)`).
Arrivals are the trace's own timestamps divided by `--compression` (in the engines' profile time) and by
the speed-up (wall clock): rate_profile = trace rate × compression; rate_wall = rate_profile × speed-up.

Times. The sim divides every simulated step by `--speedup`; with a speed-up below 1 the engines run slower
than the H200 they model, which keeps the CPU cost of 8 engines + frontend + client on 2 cores small next
to the simulated work. Every latency is reported in profile time (wall × speed-up), and throughput per
profile-second, so numbers read as on the modelled H200s; the wall values are in the JSON too.

Cache hits. The fleet hit rate is Δ`vllm:prefix_cache_hits_total` / Δ`vllm:prefix_cache_queries_total`
summed over the engines (tokens). The oracle is an upper bound for any router: one infinite cache shared by
all workers, with the engine's own rules (16-token blocks, chained prefix match, at least one prompt token
computed): a request hits every leading full block that any earlier request has had.

Shared-prefix workload: `--sp-prefixes` prefixes of `--sp-prefix-tokens` tokens, each request a uniformly
random prefix + a unique suffix of `--sp-suffix-tokens`, OSL `--sp-osl`, Poisson arrivals at `--sp-rate`
req/s (profile time); per-worker capacity (`--num-gpu-blocks`) holds fewer prefixes than the set, the
fleet holds all of them.

Writes benchmarks/results/routing.json, routing.md and routing.png.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.loadgen import RequestResult, _one, percentiles  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TRACE = ROOT / "benchmarks" / "data" / "mooncake_conversation_trace.jsonl"
TRACE_BLOCK = 512
VOCAB_LO, VOCAB_HI = 1000, 100000
MODEL = "kvyard-sim"
OUT = "routing"


# ---------------------------------------------------------------- workloads

class BlockText:
    """hash id -> 512 deterministic token ids (equal ids = equal tokens)."""

    def __init__(self, salt: int = 0) -> None:
        self.salt = salt
        self.cache: dict[int, list[int]] = {}

    def block(self, h: int) -> list[int]:
        b = self.cache.get(h)
        if b is None:
            rng = np.random.default_rng([self.salt, h])
            b = self.cache[h] = rng.integers(VOCAB_LO, VOCAB_HI, TRACE_BLOCK).tolist()
        return b


def trace_workload(path: Path, n: int, compression: float, osl_scale: float) -> list[dict]:
    rows = []
    with path.open() as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) >= n:
                break
    blocks = BlockText()
    t0 = rows[0]["timestamp"]
    out = []
    for r in rows:
        ids: list[int] = []
        for h in r["hash_ids"]:
            ids.extend(blocks.block(h))
        ids = ids[: r["input_length"]]
        out.append({"t": (r["timestamp"] - t0) / 1000.0 / compression, "prompt": ids,
                    "max_tokens": max(1, math.ceil(r["output_length"] * osl_scale))})
    return out


def shared_prefix_workload(n: int, prefixes: int, prefix_tokens: int, suffix_tokens: int, osl: int, rate: float,
                           seed: int = 7) -> list[dict]:
    rng = np.random.default_rng(seed)
    pre = [np.random.default_rng([1, p]).integers(VOCAB_LO, VOCAB_HI, prefix_tokens).tolist() for p in range(prefixes)]
    t = 0.0
    out = []
    for i in range(n):
        p = int(rng.integers(prefixes))
        suffix = np.random.default_rng([2, i]).integers(VOCAB_LO, VOCAB_HI, suffix_tokens).tolist()
        out.append({"t": t, "prompt": pre[p] + suffix, "max_tokens": osl, "prefix": p})
        t += float(rng.exponential(1.0 / rate))
    return out


def oracle_hits(workload: list[dict], block_size: int, capacity_blocks: int | None = None) -> dict:
    """Infinite cache shared by all workers: hit = leading full blocks seen in any earlier prompt (chained),
    capped so at least one prompt token is computed (vLLM's rule). With `capacity_blocks`: one pooled LRU
    cache of that many blocks instead (the fleet's capacity with perfect affinity and no load limits; a
    reference, not a bound: LRU is not the optimal eviction)."""
    from collections import OrderedDict

    seen: OrderedDict[bytes, None] = OrderedDict()
    hits = queries = 0
    for w in workload:
        ids = w["prompt"]
        arr = np.asarray(ids, dtype=np.uint32)
        parent = b""
        chain = []
        for i in range(len(ids) // block_size):
            parent = hashlib.blake2b(parent + arr[i * block_size:(i + 1) * block_size].tobytes(), digest_size=16).digest()
            chain.append(parent)
        hit_blocks = 0
        for hsh in chain:
            if hsh not in seen:
                break
            hit_blocks += 1
        hit = min(hit_blocks * block_size, ((len(ids) - 1) // block_size) * block_size)
        hits += hit
        queries += len(ids)
        for hsh in chain:
            seen[hsh] = None
            seen.move_to_end(hsh)
        if capacity_blocks is not None:
            while len(seen) > capacity_blocks:
                seen.popitem(last=False)
    return {"hits": hits, "queries": queries, "hit_rate": hits / queries if queries else None}


# ---------------------------------------------------------------- cluster

METRIC_RE = re.compile(r"^(vllm:prefix_cache_(?:hits|queries)_total)\{[^}]*\}\s+([0-9.eE+-]+)$", re.M)


async def engine_counters(client: httpx.AsyncClient, ports: list[int]) -> dict:
    tot = {"hits": 0.0, "queries": 0.0}
    for p in ports:
        text = (await client.get(f"http://127.0.0.1:{p}/metrics")).text
        for name, val in METRIC_RE.findall(text):
            tot["hits" if "hits" in name else "queries"] += float(val)
    return tot


class Cluster:
    """`kvyard up` as a child process (own session); stopped by its PID, SIGTERM then SIGKILL of its group."""

    def __init__(self, args, policy: str, num_gpu_blocks: int, tmp: Path) -> None:
        self.args, self.policy = args, policy
        self.ports = [args.base_port + i for i in range(args.workers)]
        cfg = tmp / f"up-{policy}-{num_gpu_blocks}.yaml"
        logs = tmp / f"logs-{policy}-{num_gpu_blocks}"
        conf = {"engine_args": ["--num-gpu-blocks", str(num_gpu_blocks)], "log_dir": str(logs)}
        if args.kv_overlap_weight is not None:
            conf["frontend"] = {"kv_overlap_weight": args.kv_overlap_weight}
        cfg.write_text(json.dumps(conf))
        self.cmd = [sys.executable, "-m", "orchestrator", "--log-level", "warning", "up", "--workers", str(args.workers),
                    "--policy", policy, "--speedup", str(args.speedup), "--port", str(args.port), "--base-port",
                    str(args.base_port), "--grpc-port", "0", "--block-size", str(args.block_size), "--max-model-len",
                    str(args.max_model_len), "--config", str(cfg)]
        self.log = tmp / f"up-{policy}-{num_gpu_blocks}.log"
        self.proc: subprocess.Popen | None = None

    async def __aenter__(self) -> "Cluster":
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 120
        async with httpx.AsyncClient(timeout=5) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvyard up exited: {self.log.read_text()[-2000:]}")
                try:
                    r = await c.get(f"http://127.0.0.1:{self.args.port}/api/cluster")
                    d = r.json()
                    ready = [w for w in d["workers"] if w["state"] == "ready" and w["running"] is not None]
                    if len(ready) == self.args.workers and d["policy"] == self.policy:
                        await asyncio.sleep(1.0)
                        return self
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                await asyncio.sleep(0.5)
        await self.__aexit__(None, None, None)
        raise RuntimeError(f"cluster not ready; log {self.log}")

    async def __aexit__(self, *exc) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        for _ in range(300):
            if p.poll() is not None:
                break
            await asyncio.sleep(0.1)
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the group of the process we started: stray engines, if any
        except ProcessLookupError:
            pass
        p.wait(10)


# ---------------------------------------------------------------- replay

async def replay(url: str, workload: list[dict], speedup: float, sequential: bool = False) -> dict:
    """Open loop: request i is sent at t0 + t_i / speedup (wall), whatever is in flight."""
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    results: list[RequestResult | None] = [None] * len(workload)
    lags: list[float] = []

    def body(w: dict) -> dict:
        return {"model": MODEL, "prompt": w["prompt"], "max_tokens": w["max_tokens"], "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        if sequential:
            for i, w in enumerate(workload):
                results[i] = await _one(client, url + "/v1/completions", body(w))
        else:
            async def fire(i: int, w: dict) -> None:
                delay = t0 + w["t"] / speedup - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                lags.append(time.perf_counter() - t0 - w["t"] / speedup)
                results[i] = await _one(client, url + "/v1/completions", body(w))

            await asyncio.gather(*(fire(i, w) for i, w in enumerate(workload)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r and r.ok]
    errors = [r.error for r in results if r and not r.ok]
    s = speedup  # profile time = wall × speed-up
    ttft = [r.ttft_s * 1000 * s for r in ok]
    itl = [g * 1000 * s for r in ok for g in r.gaps_s]
    tokens = sum(r.completion_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(workload), "ok": len(ok), "errors": len(errors), "error_samples": errors[:3],
        "wall_s": round(wall, 2), "profile_s": round(wall * s, 2),
        "ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl),
        "req_per_s": round(len(ok) / (wall * s), 3), "output_tok_per_s": round(tokens / (wall * s), 1),
        "prompt_tok_per_s": round(prompt_tokens / (wall * s), 1),
        "send_lag_wall_ms": percentiles([x * 1000 for x in lags]) if lags else None,
        "_ttft_all": ttft,
    }


async def run_policy(args, policy: str, workload: list[dict], num_gpu_blocks: int, tmp: Path, label: str,
                     sequential: bool = False) -> dict:
    print(f"[{label}] policy {policy}: starting 8 workers…", flush=True)
    async with Cluster(args, policy, num_gpu_blocks, tmp) as cl:
        async with httpx.AsyncClient(timeout=10) as c:
            before = await engine_counters(c, cl.ports)
            la0 = os.getloadavg()[0]
            res = await replay(f"http://127.0.0.1:{args.port}", workload, args.speedup, sequential)
            await asyncio.sleep(1.5)  # last metrics
            after = await engine_counters(c, cl.ports)
            per_worker = [w.get("generation_tokens") for w in (await c.get(f"http://127.0.0.1:{args.port}/api/cluster")).json()["workers"]]
    dh, dq = after["hits"] - before["hits"], after["queries"] - before["queries"]
    res.update({"policy": policy, "num_gpu_blocks": num_gpu_blocks, "cache_hits_tokens": dh, "cache_queries_tokens": dq,
                "hit_rate": round(dh / dq, 4) if dq else None, "loadavg_start": round(la0, 2),
                "loadavg_end": round(os.getloadavg()[0], 2), "generation_tokens_per_worker": per_worker})
    short = {k: res[k] for k in ("ok", "errors", "wall_s", "req_per_s", "hit_rate", "loadavg_end")}
    print(f"[{label}] {policy}: TTFT {res['ttft_ms']} ITL p50 {res['itl_ms']['p50']} {short}", flush=True)
    return res


# ---------------------------------------------------------------- report

def fmt(v, nd=1):
    return "–" if v is None else f"{v:,.{nd}f}"


def write_report(out: dict, cmd: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    clean = json.loads(json.dumps(out, default=float))
    for sec in ("trace", "shared_prefix"):
        for r in clean.get(sec, {}).get("runs", {}).values():
            r.pop("_ttft_all", None)
        if sec in clean and "unloaded" in clean[sec]:
            clean[sec]["unloaded"].pop("_ttft_all", None)
    (RESULTS / f"{OUT}.json").write_text(json.dumps(clean, indent=1))
    p = out["params"]
    L = ["# Routing benchmark: kv vs round-robin vs random vs least-loaded on 8 sim workers", "",
         f"Run {out['when']} on {out['machine']}; load average {out['loadavg']['start']} at start, {out['loadavg']['end']} at the end "
         "(the box is shared with other jobs). All latencies are in the engines' profile time (H200 Llama-3.1-8B-FP8 "
         f"profile; wall × speed-up {p['speedup']}); throughput per profile-second.", "",
         "```", cmd, "```", "",
         f"Fleet: {p['workers']} sim workers, block size {p['block_size']}, "
         f"max-model-len {p['max_model_len']}; each `kvyard up` is fresh (empty caches).", ""]
    tr = out.get("trace")
    if tr:
        tp = tr["params"]
        L += ["## Mooncake conversation trace", "",
              f"First {tp['requests']} requests of the trace (source kvcache-ai/Mooncake, Apache-2.0; benchmarks/data/), "
              f"spanning {tp['trace_span_s']} s of trace time. Each hash id is a fixed block of 512 token ids (full ISLs, "
              f"mean {tp['isl_mean']:.0f}, max {tp['isl_max']}); OSL scaled by {tp['osl_scale']} (mean {tp['osl_mean']:.1f}). "
              f"Arrivals on the trace's timestamps compressed {tp['compression']}× in profile time: "
              f"{tp['rate_profile']:.1f} req/s profile ({tp['rate_wall']:.2f} req/s wall). KV capacity "
              f"{tp['num_gpu_blocks']} blocks × {p['block_size']} tokens = {tp['num_gpu_blocks'] * p['block_size']:,} tokens per worker "
              f"(the slice's distinct content is {tp['distinct_tokens']:,} tokens).", ""]
        un = tr.get("unloaded")
        if un:
            L += [f"Unloaded reference (round-robin, {un['requests']} requests of the slice one at a time, max_tokens 1): "
                  f"TTFT p50 {fmt(un['ttft_ms']['p50'])} ms, p90 {fmt(un['ttft_ms']['p90'])} ms. "
                  f"Round-robin's loaded p90 / unloaded p90 = **{fmt(tr.get('rr_p90_over_unloaded'), 2)}×** (must be ≥ 3).", ""]
        L += ["| policy | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p90 | req/s | out tok/s | cache hit rate | % of oracle | errors |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        orc = tr["oracle"]["hit_rate"]
        for pol, r in tr["runs"].items():
            t, i = r["ttft_ms"], r["itl_ms"]
            L.append(f"| {pol} | {fmt(t['p50'])} | {fmt(t['p90'])} | {fmt(t['p99'])} | {fmt(i['p50'], 2)} | {fmt(i['p90'], 2)} | "
                     f"{fmt(r['req_per_s'], 2)} | {fmt(r['output_tok_per_s'], 0)} | {fmt(100 * r['hit_rate'])}% | "
                     f"{fmt(100 * r['hit_rate'] / orc)}% | {r['errors']} |")
        L.append(f"| oracle (infinite shared cache) | | | | | | | | {fmt(100 * orc)}% | 100% | |")
        if tr.get("pooled_lru"):
            pl = tr["pooled_lru"]["hit_rate"]
            L.append(f"| reference: one pooled LRU of the fleet's capacity | | | | | | | | {fmt(100 * pl)}% | {fmt(100 * pl / orc)}% | |")
        L += ["", "Times in ms. Targets (reported, not asserted): kv TTFT p90 ≤ ⅓ of round-robin's → "
              f"kv/rr = **{fmt(tr.get('kv_over_rr_p90'), 3)}**; kv hit rate ≥ 95% of the oracle's → **{fmt(tr.get('kv_hit_over_oracle_pct'))}%**.", ""]
    sp = out.get("shared_prefix")
    if sp:
        q = sp["params"]
        L += ["## Shared-prefix workload", "",
              f"{q['prefixes']} prefixes × {q['prefix_tokens']} tokens, + {q['suffix_tokens']} unique tokens, OSL {q['osl']}, "
              f"{q['requests']} requests, Poisson {q['rate']} req/s profile ({q['rate'] * p['speedup']:.2f} req/s wall). "
              f"KV capacity {q['num_gpu_blocks']} blocks = {q['num_gpu_blocks'] * p['block_size']:,} tokens per worker: "
              f"{q['prefixes_per_worker']:.1f} prefixes fit one worker, {q['prefixes_per_fleet']:.1f} the fleet.", "",
              "| policy | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | prompt-cache hit share | oracle | errors |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for pol, r in sp["runs"].items():
            t = r["ttft_ms"]
            L.append(f"| {pol} | {fmt(t['p50'])} | {fmt(t['p90'])} | {fmt(t['p99'])} | {fmt(r['itl_ms']['p50'], 2)} | "
                     f"{fmt(100 * r['hit_rate'])}% | {fmt(100 * sp['oracle']['hit_rate'])}% | {r['errors']} |")
        L += ["", "Dynamo 1.6.1 measured on this machine (reference/tools.md addendum, 8 mockers, H200 profile, 16,384 blocks, "
              "20 req/s): kv TTFT p50 25 ms vs round-robin 105 ms; prompt-cache reads 78% vs 38%.", ""]
    if out.get("notes"):
        L += ["## Notes", ""] + [f"- {n}" for n in out["notes"]] + [""]
    (RESULTS / f"{OUT}.md").write_text("\n".join(L))
    print("\n".join(L))
    plot(out)


def plot(out: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [s for s in ("trace", "shared_prefix") if s in out]
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 4.2 * len(panels)), squeeze=False)
    for row, sec in enumerate(panels):
        d = out[sec]
        ax = axes[row][0]
        for pol, r in d["runs"].items():
            v = np.sort(np.asarray(r["_ttft_all"]))
            if len(v):
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=f"{pol} (p90 {r['ttft_ms']['p90']:.0f} ms)")
        if d.get("unloaded"):
            v = np.sort(np.asarray(d["unloaded"]["_ttft_all"]))
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), "k:", label="unloaded (round-robin)")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, profile time)")
        ax.set_ylabel("CDF")
        ax.set_title(f"{sec.replace('_', ' ')}: TTFT distribution")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax = axes[row][1]
        names = list(d["runs"]) + ["oracle"]
        vals = [100 * d["runs"][n]["hit_rate"] for n in d["runs"]] + [100 * d["oracle"]["hit_rate"]]
        ax.bar(names, vals, color=["C0", "C1", "C2", "C3", "C4"][: len(names) - 1] + ["grey"])
        for x, v in enumerate(vals):
            ax.text(x, v + 0.5, f"{v:.1f}%", ha="center", fontsize=9)
        ax.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
        ax.set_title(f"{sec.replace('_', ' ')}: fleet cache hits")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{OUT}.png", dpi=110)


# ---------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvyard bench routing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="kv,round-robin,random,least-loaded")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--speedup", type=float, default=0.25, help="sim speed-up (below 1: slower than the H200)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--port", type=int, default=18590)
    ap.add_argument("--base-port", type=int, default=18600)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--requests", type=int, default=500, help="first N requests of the trace")
    ap.add_argument("--compression", type=float, default=8.0, help="trace time / profile time")
    ap.add_argument("--osl-scale", type=float, default=0.25)
    ap.add_argument("--num-gpu-blocks", type=int, default=16384, help="per worker, trace replay")
    ap.add_argument("--unloaded-requests", type=int, default=40)
    ap.add_argument("--sp-requests", type=int, default=384)
    ap.add_argument("--sp-prefixes", type=int, default=64)
    ap.add_argument("--sp-prefix-tokens", type=int, default=8192)
    ap.add_argument("--sp-suffix-tokens", type=int, default=256)
    ap.add_argument("--sp-osl", type=int, default=32)
    ap.add_argument("--sp-rate", type=float, default=20.0, help="req/s, profile time")
    ap.add_argument("--sp-num-gpu-blocks", type=int, default=16384)
    ap.add_argument("--sp-policies", default="kv,round-robin")
    ap.add_argument("--skip", default="", help="comma list of: trace, unloaded, shared")
    ap.add_argument("--kv-overlap-weight", type=float, default=None, help="frontend kv_overlap_weight (default: the frontend's, 1.0)")
    ap.add_argument("--out", default="routing", help="results/<out>.json, .md, .png")
    return ap


async def amain(args) -> dict:
    skip = set(filter(None, args.skip.split(",")))
    tmp = Path(tempfile.mkdtemp(prefix="kvyard-routing-"))
    out: dict = {"benchmark": "routing", "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "machine": f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}",
                 "loadavg": {"start": round(os.getloadavg()[0], 2)},
                 "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "notes": []}
    if "trace" not in skip:
        wl = trace_workload(args.trace, args.requests, args.compression, args.osl_scale)
        span = wl[-1]["t"] * args.compression
        distinct = len({h for r in (json.loads(x) for x, _ in zip(args.trace.open(), range(args.requests))) for h in r["hash_ids"]})
        isl = np.array([len(w["prompt"]) for w in wl])
        osl = np.array([w["max_tokens"] for w in wl])
        tr = {"params": {"requests": len(wl), "trace_span_s": round(span, 1), "compression": args.compression,
                         "rate_profile": len(wl) / (span / args.compression), "rate_wall": len(wl) / (span / args.compression) * args.speedup,
                         "osl_scale": args.osl_scale, "isl_mean": float(isl.mean()), "isl_max": int(isl.max()),
                         "osl_mean": float(osl.mean()), "num_gpu_blocks": args.num_gpu_blocks,
                         "distinct_tokens": distinct * TRACE_BLOCK},
              "oracle": oracle_hits(wl, args.block_size), "runs": {},
              "pooled_lru": oracle_hits(wl, args.block_size, args.workers * (args.num_gpu_blocks - 1))}
        out["trace"] = tr
        print(f"trace: {tr['params']} oracle {tr['oracle']}", flush=True)
        if "unloaded" not in skip:
            light = [dict(w, max_tokens=1) for w in wl[: args.unloaded_requests]]
            tr["unloaded"] = await run_policy(args, "round-robin", light, args.num_gpu_blocks, tmp, "unloaded", sequential=True)
        for pol in args.policies.split(","):
            tr["runs"][pol] = await run_policy(args, pol, wl, args.num_gpu_blocks, tmp, "trace")
        runs = tr["runs"]
        if "round-robin" in runs and tr.get("unloaded"):
            tr["rr_p90_over_unloaded"] = runs["round-robin"]["ttft_ms"]["p90"] / tr["unloaded"]["ttft_ms"]["p90"]
        if "round-robin" in runs and "kv" in runs:
            tr["kv_over_rr_p90"] = runs["kv"]["ttft_ms"]["p90"] / runs["round-robin"]["ttft_ms"]["p90"]
            tr["kv_hit_over_oracle_pct"] = 100 * runs["kv"]["hit_rate"] / tr["oracle"]["hit_rate"]
    if "shared" not in skip:
        wl = shared_prefix_workload(args.sp_requests, args.sp_prefixes, args.sp_prefix_tokens, args.sp_suffix_tokens,
                                    args.sp_osl, args.sp_rate)
        cap = args.sp_num_gpu_blocks * args.block_size
        sp = {"params": {"requests": args.sp_requests, "prefixes": args.sp_prefixes, "prefix_tokens": args.sp_prefix_tokens,
                         "suffix_tokens": args.sp_suffix_tokens, "osl": args.sp_osl, "rate": args.sp_rate,
                         "num_gpu_blocks": args.sp_num_gpu_blocks, "prefixes_per_worker": cap / args.sp_prefix_tokens,
                         "prefixes_per_fleet": cap * args.workers / args.sp_prefix_tokens},
              "oracle": oracle_hits(wl, args.block_size), "runs": {}}
        out["shared_prefix"] = sp
        for pol in args.sp_policies.split(","):
            sp["runs"][pol] = await run_policy(args, pol, wl, args.sp_num_gpu_blocks, tmp, "shared")
    out["loadavg"]["end"] = round(os.getloadavg()[0], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    global OUT
    args = build_parser().parse_args(argv)
    OUT = args.out
    out = asyncio.run(amain(args))
    cmd = "kvyard bench routing " + " ".join(argv if argv is not None else sys.argv[1:])
    out["command"] = cmd
    write_report(out, cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
