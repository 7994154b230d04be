"""Routing benchmark: the Mooncake conversation trace and a shared-prefix workload, replayed open-loop
(fixed schedule, streaming) against `kvyard up --workers 8 --policy P` over sim engines, per policy.

    python -m benchmarks routing [--requests 500 --compression 8 --speedup 0.25 ...]
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
summed over the engines (tokens). Against it, computed offline on the same workload (engine rules: 16-token
blocks, chained prefix match, at least one prompt token computed):
  oracle        one infinite cache shared by all workers: every leading block any earlier request had.
                Not achievable once the content outgrows the fleet's KV capacity.
  fleet bound   THE bound the target is measured against: one pooled cache of the fleet's total capacity
                (workers × (num_gpu_blocks − 1)) with Belady's optimal eviction, every computed block cached,
                every cached block a hit. No router over per-worker caches of that size can beat it
                (fleet_bound_hits explains why). Equal to the oracle when the reused content fits the fleet.
  pooled LRU    the same pooled cache with the engines' LRU eviction (a reference, not a bound).
  affinity LRU  an offline router that knows every cache and ignores load, over per-worker LRU caches:
                what pure affinity reaches with the engines' eviction (achievable, not a bound).
`--overlap-weights 0.5,1,2,4,8` adds one kv run per weight (the sweep).

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

from benchmarks.common import reap_group  # noqa: E402
from benchmarks.loadgen import RequestResult, _one, percentiles  # noqa: E402
from benchmarks.histdelta import hist_delta  # noqa: E402

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


def chain_hashes(ids: list[int], block_size: int) -> list[bytes]:
    """The prompt's full blocks as chained hashes (equal hash = equal block at the same prefix)."""
    arr = np.asarray(ids, dtype=np.uint32)
    parent = b""
    chain = []
    for i in range(len(ids) // block_size):
        parent = hashlib.blake2b(parent + arr[i * block_size:(i + 1) * block_size].tobytes(), digest_size=16).digest()
        chain.append(parent)
    return chain


def _max_hit_tokens(n_tokens: int, block_size: int) -> int:
    return ((n_tokens - 1) // block_size) * block_size  # vLLM computes at least one prompt token


def oracle_hits(workload: list[dict], block_size: int, capacity_blocks: int | None = None, per_request: bool = False) -> dict:
    """Infinite cache shared by all workers: hit = leading full blocks seen in any earlier prompt (chained),
    capped so at least one prompt token is computed (vLLM's rule). Not achievable once the content outgrows
    the fleet's KV capacity. With `capacity_blocks`: one pooled LRU cache of that many blocks instead (a
    reference, not a bound: LRU is not the optimal eviction)."""
    from collections import OrderedDict

    seen: OrderedDict[bytes, None] = OrderedDict()
    hits = queries = 0
    each = []
    for w in workload:
        ids = w["prompt"]
        chain = chain_hashes(ids, block_size)
        hit_blocks = 0
        for hsh in chain:
            if hsh not in seen:
                break
            hit_blocks += 1
        each.append(min(hit_blocks * block_size, _max_hit_tokens(len(ids), block_size)))
        hits += each[-1]
        queries += len(ids)
        for hsh in chain:
            seen[hsh] = None
            seen.move_to_end(hsh)
        if capacity_blocks is not None:
            while len(seen) > capacity_blocks:
                seen.popitem(last=False)
    out = {"hits": hits, "queries": queries, "hit_rate": hits / queries if queries else None}
    return {**out, "per_request": each} if per_request else out


def ttft_floor(workload: list[dict], block_size: int, profile: str = "h200-llama3.1-8b") -> dict:
    """The TTFT no router can beat on this workload: each request's own prefill at the infinite oracle's hits, on
    an idle engine (the sim's timing model of `profile`: TTFT(isl) - TTFT(hit) + the per-pass cost), in profile ms.
    Queueing behind other requests is what a router adds to it."""
    from workers.sim.profiles import load_profile
    from workers.sim.timing import TimingModel

    tm = TimingModel(load_profile(profile), 1.0)
    hits = oracle_hits(workload, block_size, per_request=True)["per_request"]
    ms = [tm.prefill_ms([(h, len(w["prompt"]) - h)]) for w, h in zip(workload, hits)]
    out = {k: round(float(np.percentile(ms, q)), 1) for k, q in (("p50", 50), ("p90", 90), ("p99", 99))}
    return {**out, "mean": round(float(np.mean(ms)), 1)}


def fleet_bound_hits(workload: list[dict], block_size: int, capacity_blocks: int, bypass: bool = False) -> dict:
    """Upper bound on the fleet's cache hits for ANY router, with the fleet's total KV capacity.

    One pooled cache of `capacity_blocks` (workers × per-worker blocks) run with Belady's optimal offline
    eviction (MIN: evict the block needed farthest in the future) over the block accesses in arrival order,
    every cached block counted as a hit wherever it sits in the prompt. As in the engines, every computed
    block enters the cache (demand paging); with `bypass` a block may also be left out when everything cached
    is needed sooner (a looser bound, for caches that could refuse blocks).
    Why it bounds every real routing: per-worker caches of C blocks each are one policy of a pooled cache of
    workers × C (the pool can hold their union), and splitting, pinning running requests' blocks, counting
    only a cached *prefix*, and prefill time (a block is cached only once its request has been prefilled) can
    each only lower the hits; MIN maximises the cached accesses of a cache of that size over the sequence.
    When the content fits the fleet, the bound is the infinite-cache oracle. Hits capped by vLLM's rule.
    """
    import heapq

    chains = [chain_hashes(w["prompt"], block_size) for w in workload]
    flat = [h for c in chains for h in c]
    never = len(flat) + 1
    next_use = [never] * len(flat)
    last: dict[bytes, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        next_use[i] = last.get(flat[i], never)
        last[flat[i]] = i
    cache: dict[bytes, int] = {}  # hash -> its next use
    heap: list[tuple[int, bytes]] = []  # (-next use, hash), stale entries skipped on pop
    hits = queries = 0
    pos = 0
    for w, chain in zip(workload, chains):
        present = 0
        for h in chain:
            nu = next_use[pos]
            pos += 1
            if h in cache:
                present += 1
                cache[h] = nu
                heapq.heappush(heap, (-nu, h))
                continue
            if bypass and nu == never:
                continue  # never needed again: leave it out
            while len(cache) >= capacity_blocks:
                far, victim = heap[0]
                if cache.get(victim) != -far:
                    heapq.heappop(heap)  # stale
                    continue
                if bypass and -far <= nu:
                    break  # everything cached is needed sooner than h: leave h out
                heapq.heappop(heap)
                del cache[victim]
            if len(cache) < capacity_blocks:
                cache[h] = nu
                heapq.heappush(heap, (-nu, h))
        hits += min(present * block_size, _max_hit_tokens(len(w["prompt"]), block_size))
        queries += len(w["prompt"])
    return {"hits": hits, "queries": queries, "hit_rate": hits / queries if queries else None,
            "capacity_blocks": capacity_blocks, "bypass": bypass}


def affinity_lru_hits(workload: list[dict], block_size: int, workers: int, capacity_blocks: int) -> dict:
    """Reference (achievable, not a bound): an offline router with perfect knowledge of every worker's cache
    and no load limit, over per-worker LRU caches of `capacity_blocks` as the engines keep them. Each request
    goes to the worker holding its longest cached prefix (ties: the next worker in turn), leading hits
    counted with vLLM's cap. What pure affinity reaches with the engines' own eviction. Not an upper
    reference: without a load term, a prefix every request shares (the Mooncake slice's first 512 tokens)
    draws everything onto one worker, whose cache then thrashes: the failure mode a load term prevents."""
    from collections import OrderedDict

    caches: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(workers)]
    hits = queries = turn = 0
    for w in workload:
        chain = chain_hashes(w["prompt"], block_size)
        best, best_n = [], -1
        for k, c in enumerate(caches):
            n = 0
            for h in chain:
                if h not in c:
                    break
                n += 1
            if n > best_n:
                best, best_n = [k], n
            elif n == best_n:
                best.append(k)
        k = min(best, key=lambda k: (k - turn) % workers)
        turn = (k + 1) % workers
        hits += min(best_n * block_size, _max_hit_tokens(len(w["prompt"]), block_size))
        queries += len(w["prompt"])
        c = caches[k]
        for h in chain:
            c[h] = None
            c.move_to_end(h)
        while len(c) > capacity_blocks:
            c.popitem(last=False)
    return {"hits": hits, "queries": queries, "hit_rate": hits / queries if queries else None}


def cache_references(workload: list[dict], args, num_gpu_blocks: int) -> dict:
    """The hit-rate bounds and references of a workload at a per-worker capacity (see the functions above)."""
    per_worker = num_gpu_blocks - 1  # vLLM keeps one null block out of the pool
    fleet = args.workers * per_worker
    return {"oracle": oracle_hits(workload, args.block_size),
            "ttft_floor_ms": ttft_floor(workload, args.block_size),
            "fleet_bound": fleet_bound_hits(workload, args.block_size, fleet),
            "pooled_lru": oracle_hits(workload, args.block_size, fleet),
            "affinity_lru": affinity_lru_hits(workload, args.block_size, args.workers, per_worker)}


# ---------------------------------------------------------------- cluster

METRIC_RE = re.compile(r"^(vllm:prefix_cache_(?:hits|queries)_total)\{[^}]*\}\s+([0-9.eE+-]+)$", re.M)
ROUTER_RE = re.compile(r"^kvyard_router_(overlap_blocks|best_overlap_blocks|prompt_blocks)_total\{[^}]*\}\s+([0-9.eE+-]+)$", re.M)


async def router_counters(client: httpx.AsyncClient, port: int) -> dict:
    """The frontend's view: blocks it predicted cached on the chosen worker, on the best-holding worker, of all
    prompts; and, per worker, the blocks its KV events stored and removed (evictions)."""
    tot = {"overlap_blocks": 0.0, "best_overlap_blocks": 0.0, "prompt_blocks": 0.0}
    for name, val in ROUTER_RE.findall((await client.get(f"http://127.0.0.1:{port}/metrics")).text):
        tot[name] += float(val)
    events = (await client.get(f"http://127.0.0.1:{port}/api/cluster")).json()["kv"]["events"] or {}
    tot["blocks_stored"] = {w: s.get("blocks_stored", 0) for w, s in events.items()}
    tot["blocks_removed"] = {w: s.get("blocks_removed", 0) for w, s in events.items()}
    return tot


async def engine_counters(client: httpx.AsyncClient, ports: list[int]) -> dict:
    """Prefix-cache counters summed over the engines, and their /metrics texts (for the histograms)."""
    tot: dict = {"hits": 0.0, "queries": 0.0}
    texts = []
    for p in ports:
        text = (await client.get(f"http://127.0.0.1:{p}/metrics")).text
        texts.append(text)
        for name, val in METRIC_RE.findall(text):
            tot["hits" if "hits" in name else "queries"] += float(val)
    tot["texts"] = "\n".join(texts)
    return tot


# where a request's TTFT went, as the engines measured it: waiting for the scheduler, then its prefill steps
# (which also carry the decode batch and other prompts' chunks)
ENGINE_PHASES = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds"}


def engine_phases(before: str, after: str, speedup: float) -> dict:
    """Mean and quantiles of each phase over the run, in profile ms (the histograms' buckets bound the quantiles)."""
    out = {}
    for key, name in ENGINE_PHASES.items():
        d = hist_delta(before, after, name)
        out[key] = {k: (round(v * 1000 * speedup, 1) if v is not None else None) if k != "n" else v for k, v in d.items()}
    return out


class Cluster:
    """`kvyard up` as a child process (own session); stopped by its PID, SIGTERM then SIGKILL of its group."""

    def __init__(self, args, policy: str, num_gpu_blocks: int, tmp: Path, kv: dict | None = None) -> None:
        kv = kv or {}
        tag = f"{policy}-{num_gpu_blocks}" + "".join(f"-{k}{v:g}" for k, v in sorted(kv.items()))
        self.setup(args, policy, tmp, tag, num_gpu_blocks, ["--workers", str(args.workers)],
                   {"router": {"kv": kv}} if kv else {})
        self.ports = [args.base_port + i for i in range(args.workers)]

    def setup(self, args, policy: str, tmp: Path, tag: str, num_gpu_blocks: int, pool_args: list[str], frontend: dict) -> None:
        """Write one run's `kvyard up` config (engine KV capacity, log folder, frontend settings) and command line;
        `pool_args` says which workers to start."""
        self.args, self.policy, self.ports = args, policy, []
        cfg = tmp / f"up-{tag}.yaml"
        conf = {"engine_args": ["--num-gpu-blocks", str(num_gpu_blocks), *getattr(args, "engine_extra", [])],
                "log_dir": str(tmp / f"logs-{tag}")}
        if frontend:
            conf["frontend"] = frontend
        cfg.write_text(json.dumps(conf))
        self.cmd = [sys.executable, "-m", "orchestrator", "--log-level", "warning", "up", *pool_args, "--policy", policy,
                    "--speedup", str(args.speedup), "--port", str(args.port), "--base-port", str(args.base_port),
                    "--grpc-port", "0", "--block-size", str(args.block_size), "--max-model-len", str(args.max_model_len),
                    "--config", str(cfg)]
        self.log = tmp / f"up-{tag}.log"
        self.proc: subprocess.Popen | None = None

    start_timeout_s = 120.0

    def ready_ports(self, cluster: dict) -> list[int] | None:
        """From /api/cluster: the engine ports to read counters from once every worker is ready, else None.
        The launcher moves an engine to the next free port when its own is still taken (a previous run's engine
        not yet gone): read where each one listens instead of assuming base_port + i."""
        ready = [w for w in cluster["workers"] if w["state"] == "ready" and w["running"] is not None]
        if len(ready) == self.args.workers and cluster["policy"] == self.policy:
            return sorted(httpx.URL(w["url"]).port for w in ready)
        return None

    async def __aenter__(self) -> "Cluster":
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        async with httpx.AsyncClient(timeout=5) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvyard up exited: {self.log.read_text()[-2000:]}")
                try:
                    ports = self.ready_ports((await c.get(f"http://127.0.0.1:{self.args.port}/api/cluster")).json())
                    if ports is not None:
                        self.ports = ports
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
        await reap_group(p, 30.0)  # then the group of the process we started: stray engines, if any


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
        "prompt_tok_per_s": round(prompt_tokens / (wall * s), 1), "prompt_tokens": prompt_tokens,
        "send_lag_wall_ms": percentiles([x * 1000 for x in lags]) if lags else None,
        "_ttft_all": ttft,
    }


async def run_policy(args, policy: str, workload: list[dict], num_gpu_blocks: int, tmp: Path, label: str,
                     sequential: bool = False, kv: dict | None = None) -> dict:
    print(f"[{label}] policy {policy}: starting 8 workers…", flush=True)
    async with Cluster(args, policy, num_gpu_blocks, tmp, kv) as cl:
        async with httpx.AsyncClient(timeout=10) as c:
            before = await engine_counters(c, cl.ports)
            r_before = await router_counters(c, args.port)
            la0 = os.getloadavg()[0]
            res = await replay(f"http://127.0.0.1:{args.port}", workload, args.speedup, sequential)
            await asyncio.sleep(1.5)  # last metrics
            after = await engine_counters(c, cl.ports)
            r_after = await router_counters(c, args.port)
            per_worker = [w.get("generation_tokens") for w in (await c.get(f"http://127.0.0.1:{args.port}/api/cluster")).json()["workers"]]
    dh, dq = after["hits"] - before["hits"], after["queries"] - before["queries"]
    res["engine_phases_ms"] = engine_phases(before["texts"], after["texts"], args.speedup)
    rd = {k: r_after[k] - r_before[k] for k in ("overlap_blocks", "best_overlap_blocks", "prompt_blocks")}
    if rd["prompt_blocks"]:  # token shares, as the engines' hit rate (blocks × block size / prompt tokens)
        bs = args.block_size
        res["router"] = {**rd, "predicted_hit_rate_chosen": round(rd["overlap_blocks"] * bs / max(1, res["prompt_tokens"]), 4),
                         "predicted_hit_rate_best": round(rd["best_overlap_blocks"] * bs / max(1, res["prompt_tokens"]), 4),
                         "blocks_removed": {w: v - r_before["blocks_removed"].get(w, 0) for w, v in r_after["blocks_removed"].items()},
                         "blocks_stored": {w: v - r_before["blocks_stored"].get(w, 0) for w, v in r_after["blocks_stored"].items()}}
    kv = kv or {}
    res.update({"policy": policy, "overlap_weight": kv.get("overlap_weight"), "reuse_weight": kv.get("reuse_weight"),
                "request_weight": kv.get("request_weight"), "prefill_drain": kv.get("prefill_drain"), "num_gpu_blocks": num_gpu_blocks, "cache_hits_tokens": dh, "cache_queries_tokens": dq,
                "hit_rate": round(dh / dq, 4) if dq else None, "loadavg_start": round(la0, 2),
                "loadavg_end": round(os.getloadavg()[0], 2), "generation_tokens_per_worker": per_worker})
    short = {k: res[k] for k in ("ok", "errors", "wall_s", "req_per_s", "hit_rate", "loadavg_end")}
    phases = {k: v["mean"] for k, v in res["engine_phases_ms"].items()}
    print(f"[{label}] {policy} {kv or ''}: TTFT {res['ttft_ms']} ITL p50 {res['itl_ms']['p50']} engine mean ms {phases} {short}", flush=True)
    return res


# ---------------------------------------------------------------- report

def fmt(v, nd=1):
    return "–" if v is None else f"{v:,.{nd}f}"


REFERENCES = [("fleet_bound", "fleet bound (pooled fleet capacity, Belady; no router can beat it)"),
              ("oracle", "oracle (infinite shared cache)"),
              ("pooled_lru", "reference: pooled fleet capacity, LRU"),
              ("affinity_lru", "reference: affinity-only offline router (no load term), per-worker LRU")]


def reference_rows(sec: dict, bound: float, blanks: int) -> list[str]:
    """Table rows of the offline hit-rate references present in a section (hit-rate column, % of bound)."""
    pad = "| " * blanks
    return [f"| {title} {pad}| {fmt(100 * sec[key]['hit_rate'])}% | {fmt(100 * sec[key]['hit_rate'] / bound)}% | |"
            for key, title in REFERENCES if sec.get(key)]


def rounds_lines(runs: dict, bound: float) -> list[str]:
    """With --repeats: the rows above are medians; this says what each round read."""
    if not any(r.get("rounds") for r in runs.values()):
        return []
    L = [f"Rows are medians over {len(next(iter(runs.values()))['rounds'])} rounds (each policy once per round, "
         "rounds back to back, a fresh cluster per run). Per round, TTFT p90 ms / hit rate as % of the fleet bound:", ""]
    for pol, r in runs.items():
        L.append(f"- {pol}: " + "; ".join(f"{fmt(x['ttft_ms']['p90'])} / {fmt(100 * x['hit_rate'] / bound)}%"
                                          for x in r["rounds"]))
    return L + [""]


def phase_lines(runs: dict) -> list[str]:
    """Where each policy's TTFT went, from the engines' own histograms (means over all requests of the run)."""
    have = {pol: r["engine_phases_ms"] for pol, r in runs.items() if r.get("engine_phases_ms")}
    if not have:
        return []
    L = ["Where the time to first token went, by the engines' own histograms (mean ms per request, profile time; medians "
         "over the rounds): waiting for the scheduler (`vllm:request_queue_time_seconds`), then the prefill steps until the "
         "first token (`vllm:request_prefill_time_seconds`: the prompt's own chunks, and the steps it shares with other "
         "prompts' chunks and the decode batch). The client's TTFT adds the frontend, the network and the first token's relay.", ""]
    for pol, ph in have.items():
        q, pf = ph.get("queue", {}).get("mean"), ph.get("prefill", {}).get("mean")
        L.append(f"- {pol}: queue {fmt(q)} + prefill {fmt(pf)} ms (client TTFT mean {fmt(runs[pol]['ttft_ms'].get('mean'))} ms)")
    return L + [""]


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
        fl = tr.get("ttft_floor_ms")
        if fl:
            L += [f"TTFT floor (each request's own prefill at the infinite oracle's hits on an idle engine, from the profile; "
                  f"no router beats it, queueing is what routing adds): p50 {fmt(fl['p50'])} ms, p90 {fmt(fl['p90'])} ms, "
                  f"p99 {fmt(fl['p99'])} ms" + (f", mean {fmt(fl['mean'])} ms." if fl.get("mean") is not None else "."), ""]
        L += ["| policy | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p90 | req/s | out tok/s | cache hit rate | % of fleet bound | errors |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        bound = (tr.get("fleet_bound") or tr["oracle"])["hit_rate"]
        for pol, r in tr["runs"].items():
            t, i = r["ttft_ms"], r["itl_ms"]
            L.append(f"| {pol} | {fmt(t['p50'])} | {fmt(t['p90'])} | {fmt(t['p99'])} | {fmt(i['p50'], 2)} | {fmt(i['p90'], 2)} | "
                     f"{fmt(r['req_per_s'], 2)} | {fmt(r['output_tok_per_s'], 0)} | {fmt(100 * r['hit_rate'])}% | "
                     f"{fmt(100 * r['hit_rate'] / bound)}% | {r['errors']} |")
        L += reference_rows(tr, bound, 7)
        if tr.get("kv_over_rr_p90") is None:  # a sweep (kv rows labelled by their parameters) or no round-robin run
            L += ["", "Times in ms. Targets (kv TTFT p90 ≤ ⅓ of round-robin's, kv hit rate ≥ 95% of the fleet bound's): this run "
                  "has no plain `kv` row beside round-robin; read each kv row against the round-robin and bound rows.", ""]
        else:
            rr_note = ""
            if tr.get("kv_over_rr_p90_rounds"):
                rr_note = (" (the median of the rounds' own ratios: "
                           + ", ".join(fmt(x, 3) for x in tr["kv_over_rr_p90_rounds"]) + ")")
            L += ["", "Times in ms. Targets (reported, not asserted): kv TTFT p90 ≤ ⅓ of round-robin's → "
                  f"kv/rr = **{fmt(tr.get('kv_over_rr_p90'), 3)}**{rr_note}; kv hit rate ≥ 95% of the fleet bound's → "
                  f"**{fmt(tr.get('kv_hit_over_bound_pct'))}%** (of the infinite oracle: {fmt(tr.get('kv_hit_over_oracle_pct'))}%).", ""]
        L += rounds_lines(tr["runs"], bound)
        L += phase_lines(tr["runs"])
    sp = out.get("shared_prefix")
    if sp:
        q = sp["params"]
        L += ["## Shared-prefix workload", "",
              f"{q['prefixes']} prefixes × {q['prefix_tokens']} tokens, + {q['suffix_tokens']} unique tokens, OSL {q['osl']}, "
              f"{q['requests']} requests, Poisson {q['rate']} req/s profile ({q['rate'] * p['speedup']:.2f} req/s wall). "
              f"KV capacity {q['num_gpu_blocks']} blocks = {q['num_gpu_blocks'] * p['block_size']:,} tokens per worker: "
              f"{q['prefixes_per_worker']:.1f} prefixes fit one worker, {q['prefixes_per_fleet']:.1f} the fleet.", "",
              "| policy | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | prompt-cache hit share | % of fleet bound | errors |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
        bound = (sp.get("fleet_bound") or sp["oracle"])["hit_rate"]
        for pol, r in sp["runs"].items():
            t = r["ttft_ms"]
            L.append(f"| {pol} | {fmt(t['p50'])} | {fmt(t['p90'])} | {fmt(t['p99'])} | {fmt(r['itl_ms']['p50'], 2)} | "
                     f"{fmt(100 * r['hit_rate'])}% | {fmt(100 * r['hit_rate'] / bound)}% | {r['errors']} |")
        L += reference_rows(sp, bound, 4)
        L += [""] + rounds_lines(sp["runs"], bound)
        L += [""]
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
        ttft_cdf_lines(ax, [(pol, r, {}) for pol, r in d["runs"].items()])
        if d.get("unloaded"):
            v = np.sort(np.asarray(d["unloaded"]["_ttft_all"]))
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), "k:", label="unloaded (round-robin)")
        ttft_cdf_axes(ax, f"{sec.replace('_', ' ')}: TTFT distribution")
        bound = d.get("fleet_bound") or d["oracle"]
        names = list(d["runs"]) + ["fleet bound"]
        hit_bars(axes[row][1], names, [100 * d["runs"][n]["hit_rate"] for n in d["runs"]] + [100 * bound["hit_rate"]],
                 [f"C{i % 10}" for i in range(len(names) - 1)] + ["grey"], f"{sec.replace('_', ' ')}: fleet cache hits",
                 30 if len(names) > 5 else 0)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{OUT}.png", dpi=110)


def ttft_cdf_lines(ax, runs: list[tuple[str, dict, dict]]) -> None:
    """One TTFT CDF line per (label, run, matplotlib style) whose run recorded TTFTs."""
    for label, r, style in runs:
        v = np.sort(np.asarray(r["_ttft_all"]))
        if len(v):
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=f"{label} (p90 {r['ttft_ms']['p90']:.0f} ms)", **style)


def ttft_cdf_axes(ax, title: str) -> None:
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, profile time)")
    ax.set_ylabel("CDF")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def hit_bars(ax, names: list[str], pcts: list[float], colors: list[str], title: str, rotation: int) -> None:
    """Cache-hit rate bars, each labelled with its value."""
    ax.bar(names, pcts, color=colors, edgecolor="k", alpha=0.85)
    ax.tick_params(axis="x", labelrotation=rotation)
    for x, v in enumerate(pcts):
        ax.text(x, v + 0.5, f"{v:.1f}%", ha="center", fontsize=9)
    ax.set_ylim(0, 1.12 * max(pcts, default=0) + 1)  # room for the labels under the title
    ax.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax.set_title(title)


# ---------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks routing", description=__doc__,
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
    ap.add_argument("--kv-overlap-weight", type=float, default=None, help="frontend.router.kv.overlap_weight (default: the frontend's)")
    ap.add_argument("--kv-reuse-weight", type=float, default=None, help="frontend.router.kv.reuse_weight (default: the frontend's)")
    ap.add_argument("--reuse-weights", default="", help="sweep: also run kv once per reuse weight, e.g. 1,2,4")
    ap.add_argument("--overlap-weights", default="", help="sweep: also run kv once per weight, e.g. 0.5,1,2,4,8")
    ap.add_argument("--kv-request-weight", type=float, default=None, help="frontend.router.kv.request_weight (default: the frontend's)")
    ap.add_argument("--kv-pairs", default="",
                    help="sweep: also run kv once per overlap:reuse[:request[:pending_ttl_s[:drain]]] setting, e.g. "
                         "8:16,16:8:16:0,16:8:16:10:1 (drain 0|1: router.kv.prefill_drain; the frontend's for what is not given)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of every run, interleaved (kv, round-robin, kv, ...), each on a fresh cluster; the "
                         "report gives per-policy medians and the per-round kv/round-robin ratios")
    ap.add_argument("--out", default="routing", help="results/<out>.json, .md, .png")
    return ap


def run_list(args, policies: str) -> list[tuple[str, str, dict]]:
    """(label, policy, kv settings for the frontend) per run: the policies, then kv once per --overlap-weights
    entry and once per --reuse-weights entry (each with the other setting as given, or the frontend's default),
    then once per --kv-pairs overlap:reuse[:request[:pending_ttl_s[:drain]]] setting (those set)."""
    given = (("overlap_weight", args.kv_overlap_weight), ("reuse_weight", args.kv_reuse_weight),
             ("request_weight", args.kv_request_weight))
    base = {k: v for k, v in given if v is not None}
    runs = [(p, p, base if p == "kv" else {}) for p in filter(None, policies.split(","))]
    for w in filter(None, args.overlap_weights.split(",")):
        runs.append((f"kv w={float(w):g}", "kv", {**base, "overlap_weight": float(w)}))
    for w in filter(None, args.reuse_weights.split(",")):
        runs.append((f"kv reuse={float(w):g}", "kv", {**base, "reuse_weight": float(w)}))
    for pair in filter(None, getattr(args, "kv_pairs", "").split(",")):
        try:
            vals = [float(x) for x in pair.split(":")]
        except ValueError:
            vals = []
        if len(vals) not in (2, 3, 4, 5) or (len(vals) == 5 and vals[4] not in (0, 1)):
            raise SystemExit(f"--kv-pairs: {pair!r} is not overlap:reuse[:request[:pending_ttl_s[:drain 0|1]]]")
        kv = dict(zip(("overlap_weight", "reuse_weight", "request_weight", "pending_ttl_s"), vals))
        if len(vals) == 5:
            kv["prefill_drain"] = bool(vals[4])
        label = f"kv w={vals[0]:g} reuse={vals[1]:g}" + "".join(f" {k}={v:g}" for k, v in zip(("req", "pend", "drain"), vals[2:]))
        runs.append((label, "kv", kv))
    return runs


def median_run(rounds: list[dict]) -> dict:
    """One row for a policy run several times: every number is the median over the rounds (each latency
    percentile on its own), lists and strings are the first round's; `rounds` keeps each round's headline."""
    if len(rounds) == 1:
        return rounds[0]

    def med(vals: list):
        first = vals[0]
        if isinstance(first, dict):
            return {k: med([v.get(k) for v in vals]) for k in first}
        nums = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if nums and len(nums) == len(vals):
            return round(float(np.median(nums)), 4)
        return first

    out = {k: (v if k == "_ttft_all" else med([r.get(k) for r in rounds])) for k, v in rounds[0].items()}
    out["_ttft_all"] = [x for r in rounds for x in r.get("_ttft_all", [])]
    out["errors"] = sum(r.get("errors", 0) for r in rounds)  # a median would hide a round's failures
    out["error_samples"] = [e for r in rounds for e in r.get("error_samples", [])][:3]
    out["rounds"] = [{"ttft_ms": r["ttft_ms"], "hit_rate": r.get("hit_rate"), "req_per_s": r.get("req_per_s"),
                      "loadavg_end": r.get("loadavg_end")} for r in rounds]
    return out


async def run_rounds(args, runs: list[tuple[str, str, dict]], workload: list[dict], num_gpu_blocks: int, tmp: Path,
                     label: str) -> dict:
    """Every run `args.repeats` times, round by round (so a slow spell of the shared box hits every policy in
    its round, not one policy's all rounds); a fresh cluster each time."""
    per: dict[str, list[dict]] = {name: [] for name, _, _ in runs}
    for rnd in range(max(1, args.repeats)):
        for name, pol, kv in runs:
            tag = label if args.repeats <= 1 else f"{label} round {rnd + 1}/{args.repeats}"
            per[name].append(await run_policy(args, pol, workload, num_gpu_blocks, tmp, tag, kv=kv))
    return {name: median_run(rs) for name, rs in per.items()}


def paired_ratios(runs: dict, a: str = "kv", b: str = "round-robin") -> list[float]:
    """a's TTFT p90 over b's, round by round (the same round ran both back to back)."""
    ra = runs[a].get("rounds") or [runs[a]]
    rb = runs[b].get("rounds") or [runs[b]]
    return [x["ttft_ms"]["p90"] / y["ttft_ms"]["p90"] for x, y in zip(ra, rb)]


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
              **cache_references(wl, args, args.num_gpu_blocks), "runs": {}}
        out["trace"] = tr
        print(f"trace: {tr['params']} oracle {tr['oracle']}", flush=True)
        if "unloaded" not in skip:
            light = [dict(w, max_tokens=1) for w in wl[: args.unloaded_requests]]
            tr["unloaded"] = await run_policy(args, "round-robin", light, args.num_gpu_blocks, tmp, "unloaded", sequential=True)
        tr["runs"] = await run_rounds(args, run_list(args, args.policies), wl, args.num_gpu_blocks, tmp, "trace")
        runs = tr["runs"]
        if "round-robin" in runs and tr.get("unloaded"):
            tr["rr_p90_over_unloaded"] = runs["round-robin"]["ttft_ms"]["p90"] / tr["unloaded"]["ttft_ms"]["p90"]
        if "round-robin" in runs and "kv" in runs:
            ratios = paired_ratios(runs)
            tr["kv_over_rr_p90"] = float(np.median(ratios))  # one round: the plain ratio
            if len(ratios) > 1:
                tr["kv_over_rr_p90_rounds"] = [round(x, 4) for x in ratios]
            tr["kv_hit_over_oracle_pct"] = 100 * runs["kv"]["hit_rate"] / tr["oracle"]["hit_rate"]
            tr["kv_hit_over_bound_pct"] = 100 * runs["kv"]["hit_rate"] / tr["fleet_bound"]["hit_rate"]
    if "shared" not in skip:
        wl = shared_prefix_workload(args.sp_requests, args.sp_prefixes, args.sp_prefix_tokens, args.sp_suffix_tokens,
                                    args.sp_osl, args.sp_rate)
        cap = args.sp_num_gpu_blocks * args.block_size
        sp = {"params": {"requests": args.sp_requests, "prefixes": args.sp_prefixes, "prefix_tokens": args.sp_prefix_tokens,
                         "suffix_tokens": args.sp_suffix_tokens, "osl": args.sp_osl, "rate": args.sp_rate,
                         "num_gpu_blocks": args.sp_num_gpu_blocks, "prefixes_per_worker": cap / args.sp_prefix_tokens,
                         "prefixes_per_fleet": cap * args.workers / args.sp_prefix_tokens},
              **cache_references(wl, args, args.sp_num_gpu_blocks), "runs": {}}
        out["shared_prefix"] = sp
        sp["runs"] = await run_rounds(args, run_list(args, args.sp_policies), wl, args.sp_num_gpu_blocks, tmp, "shared")
    out["loadavg"]["end"] = round(os.getloadavg()[0], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    global OUT
    args = build_parser().parse_args(argv)
    OUT = args.out
    out = asyncio.run(amain(args))
    cmd = "python -m benchmarks routing " + " ".join(argv if argv is not None else sys.argv[1:])
    out["command"] = cmd
    write_report(out, cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
