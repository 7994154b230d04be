"""kvyard's frontend beside the Rust routers (vllm-router, the SGLang model gateway), in front of the same sim
engines, with the same load from the same client, each router in turn, in one run.

    scripts/install_routers.sh          # once: vllm-router 0.1.17, sglang-router 0.3.2 (and aiperf 0.13.0), own venvs
    PYTHONPATH=. .venv/bin/python benchmarks/routers_compare.py [--quick] [--baseline PATH] [--client aiperf|loadgen]
        [--trace-routers LABELS] [--stream-routers LABELS]

Routers (labels; --trace-routers and --stream-routers pick them, comma-separated):
  kvyard-kv, kvyard-rr           `python -m orchestrator frontend --policy kv|round-robin` from this checkout; the
                                 engines are registered in Redis (127.0.0.1:6379) with their KV-event sockets.
  kvyard-baseline-kv, -rr        the same from another checkout (`--baseline PATH`, e.g. `git archive REV | tar -x`
                                 with router/_kvcore*.so copied in; copied from this tree when missing), so a code
                                 change is A/B'd in one run. Only with --baseline.
  vllm-router-rr, vllm-router-ca `vllm-router --policy round_robin|cache_aware --worker-urls ...` (.venv-vllm-router)
  sglang-ca                      `smg launch --policy cache_aware --worker-urls ...` (.venv-sglang-router)
Every router gets the engines' HTTP URLs; only kvyard also reads their KV events (its kv policy needs them).

Engines: --engines sim engines (`python -m workers.sim`, H200 Llama-3.1-8B-FP8 profile, 16-token blocks) from this
checkout, the same command for every router. For the trace workload each router gets a fresh fleet (empty prefix
caches); for the streaming workload one fleet per concurrency level serves every router in turn (distinct prompts).

Client (the same for every router): aiperf 0.13.0 (`--client aiperf`, the default; .venv-aiperf, offline: the sim's
tokenizer laid out as the hub cache entry `local/cl100k`; `--use-server-token-count`; `--no-server-metrics`: aiperf
scrapes <url>/metrics by default, and only kvyard serves its metrics on the API port, so only kvyard paid for those
scrapes), one `aiperf profile` per run;
or `--client loadgen`, benchmarks/loadgen.py's streaming reader in this process.
Workloads (all /v1/chat/completions, streamed, `ignore_eos`, usage chunk):
  trace   benchmarks/data/mooncake_conversation_trace.jsonl: of its first --trace-window (1,000) rows, the ones that
          share at least --min-shared-blocks (2) leading 512-token blocks with another (the multi-turn conversations:
          378 rows, 47% of their blocks a prefix seen before), at most --trace-requests; open loop on the trace's
          timestamps / --compression (wall clock), engines at --trace-speedup. (The first 300 rows alone reuse only
          8% of their blocks: the turns of a conversation are minutes apart.) Each 512-token hash id
          becomes 512 tokens of text, so prompts share exactly the prefixes the trace says they share, in text (what
          the SGLang gateway's cache_aware tree sees) and in tokens (what the engines' prefix caches and kvyard's
          index see): aiperf synthesizes that text itself from the rows (timestamps rebased and divided by
          --compression); loadgen uses 512 words that are one cl100k token each (a seeded draw per id).
          max_tokens = output_length × --osl-scale.
  stream  64-token prompts (distinct per request and per router), 512 output tokens, closed loop at each --concurrency
          (--stream-requests per level), engines paced at --stream-speedup so the box is not saturated; the
          sim sends one token per chunk, and the report shows the tokens per chunk each router delivered.

Per router and workload: TTFT p50/p90 (wall ms), output tokens/s (wall), the fleet's prompt-cache hit rate
(Δ vllm:prefix_cache_hits_total / Δ vllm:prefix_cache_queries_total over the engines), and the router process's
CPU-seconds over the load: utime+stime of the process (all its threads) and of every live descendant, plus the
cutime+cstime of children already reaped, from /proc, sampled every 0.2 s and interpolated at the load's start and
end (aiperf's start_time/end_time: its own start-up is left out). Then per request and per 1,000 output
tokens, and kvyard/peer ratios.

Writes benchmarks/results/routers_compare.{json,md,png} (--out renames).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import reap_group  # noqa: E402
from benchmarks.loadgen import RequestResult, _one, percentiles  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TRACE = ROOT / "benchmarks" / "data" / "mooncake_conversation_trace.jsonl"
SIM_TOKENIZER = ROOT / "workers" / "sim" / "tokenizer"
MODEL = "kvyard-sim"
TRACE_BLOCK = 512
TICKS = os.sysconf("SC_CLK_TCK")
METRIC_RE = re.compile(r"^(vllm:prefix_cache_(?:hits|queries)_total)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)

ALL_ROUTERS = ["kvyard-kv", "kvyard-rr", "kvyard-baseline-kv", "kvyard-baseline-rr", "vllm-router-rr", "vllm-router-ca",
               "sglang-ca"]
DEFAULT_TRACE_ROUTERS = "kvyard-kv,kvyard-baseline-kv,kvyard-rr,vllm-router-rr,vllm-router-ca,sglang-ca"
DEFAULT_STREAM_ROUTERS = "kvyard-kv,kvyard-baseline-kv,vllm-router-rr,sglang-ca"


# ---------------------------------------------------------------- helpers (unit-tested)

def parse_stat(text: str) -> dict:
    """One /proc/<pid>/stat line: pid, ppid and the CPU clock ticks (utime, stime of the process, all threads;
    cutime, cstime of its reaped children). The command name may hold spaces and parentheses: split after the
    last ')'."""
    head, rest = text.rsplit(")", 1)
    f = rest.split()
    return {"pid": int(head.split("(", 1)[0]), "ppid": int(f[1]), "utime": int(f[11]), "stime": int(f[12]),
            "cutime": int(f[13]), "cstime": int(f[14])}


def tree_cpu_seconds(pid: int, proc: Path = Path("/proc"), ticks: int = TICKS) -> float:
    """CPU-seconds of a process and everything under it: its own utime+stime (every thread), the cutime+cstime
    of children it has reaped, and the same for each live descendant (found by ppid). 0 when it is gone."""
    stats = {}
    for d in proc.iterdir():
        if d.name.isdigit():
            try:
                s = parse_stat((d / "stat").read_text())
            except (OSError, ValueError, IndexError):
                continue
            stats[s["pid"]] = s
    if pid not in stats:
        return 0.0
    children: dict[int, list[int]] = {}
    for s in stats.values():
        children.setdefault(s["ppid"], []).append(s["pid"])
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        s = stats[p]
        total += s["utime"] + s["stime"] + s["cutime"] + s["cstime"]
        todo.extend(children.get(p, []))
    return total / ticks


def cpu_in_window(samples: list[tuple[float, float]], t0: float, t1: float) -> float:
    """CPU-seconds spent between t0 and t1 from (time, cumulative CPU-seconds) samples, linearly interpolated
    (clamped to the first and last sample)."""
    ts = [t for t, _ in samples]
    cs = [c for _, c in samples]
    return float(np.interp(t1, ts, cs) - np.interp(t0, ts, cs))


def box_cpu(text: str) -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs from /proc/stat's first line (idle and iowait count as not busy)."""
    f = [int(x) for x in text.split("\n", 1)[0].split()[1:]]
    total = sum(f[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return total - f[3] - f[4], total


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """Share of the machine's CPU time that was busy between two box_cpu readings."""
    dt = after[1] - before[1]
    return round((after[0] - before[0]) / dt, 3) if dt > 0 else None


def cost_row(summary: dict, cpu_s: float) -> dict:
    """Router CPU per request and per 1,000 output tokens, and output tokens per CPU-second, from a run summary
    (`ok`, `output_tokens`) and the router's CPU-seconds over it."""
    ok, tokens = summary["ok"], summary["output_tokens"]
    return {"cpu_s": round(cpu_s, 3),
            "cpu_ms_per_request": round(cpu_s * 1000 / ok, 3) if ok else None,
            "cpu_s_per_1k_tokens": round(cpu_s * 1000 / tokens, 4) if tokens else None,
            "tokens_per_cpu_s": round(tokens / cpu_s, 1) if cpu_s > 0 else None}


RATIO_KEYS = {"ttft_p50": ("ttft_ms", "p50"), "ttft_p90": ("ttft_ms", "p90"), "output_tok_per_s": ("output_tok_per_s",),
              "hit_rate": ("hit_rate",), "cpu_ms_per_request": ("cpu_ms_per_request",),
              "cpu_s_per_1k_tokens": ("cpu_s_per_1k_tokens",)}


def _get(row: dict, path: tuple):
    for k in path:
        row = row.get(k) if isinstance(row, dict) else None
    return row


def ratios(runs: dict[str, dict], mine: str, peers: list[str]) -> dict[str, dict]:
    """{peer: {metric: mine / peer}} for the peers present (None where either side is missing or zero)."""
    out = {}
    if mine not in runs:
        return out
    for peer in peers:
        if peer == mine or peer not in runs:
            continue
        row = {}
        for name, path in RATIO_KEYS.items():
            a, b = _get(runs[mine], path), _get(runs[peer], path)
            row[name] = round(a / b, 3) if a is not None and b else None
        out[peer] = row
    return out


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    """TTFT (wall ms), output tokens/s (wall), tokens per streamed chunk, over the requests of one run."""
    ok = [r for r in results if r is not None and r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    chunks = sum(len(r.gaps_s) + 1 for r in ok)
    errors = [r.error for r in results if r is not None and not r.ok]
    return {"requests": len(results), "ok": len(ok), "errors": len(errors), "error_samples": errors[:3],
            "wall_s": round(wall_s, 2), "output_tokens": tokens,
            "prompt_tokens": sum(r.prompt_tokens for r in ok),
            "ttft_ms": percentiles([r.ttft_s * 1000 for r in ok]),
            "itl_ms": percentiles([g * 1000 for r in ok for g in r.gaps_s]),
            "output_tok_per_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
            "tokens_per_chunk": round(tokens / chunks, 3) if chunks else None}


# ---------------------------------------------------------------- prompts

class Words:
    """Single-token cl100k words (' abc'): n of them are exactly n tokens, so text keeps the trace's block
    boundaries. Block h of the trace = 512 words from a generator seeded with h."""

    def __init__(self, tokenizer_dir: Path = SIM_TOKENIZER) -> None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        words = (tok.decode([i]) for i in range(tok.get_vocab_size()))
        self.words = np.array(sorted({w for w in words if re.fullmatch(r" [a-z]{3,9}", w)}))
        self.cache: dict[int, str] = {}

    def block(self, h: int) -> list[str]:
        return list(self.words[np.random.default_rng([7, h]).integers(0, len(self.words), TRACE_BLOCK)])

    def text(self, n: int, seed: int) -> str:
        return "".join(self.words[np.random.default_rng([9, seed]).integers(0, len(self.words), n)])


def multi_turn_rows(rows: list[dict], min_shared: int) -> list[dict]:
    """The rows that share at least `min_shared` leading hash ids with another row of `rows` (a later turn of the
    same conversation, or the earlier one it extends), in trace order. Rows that share only a common first block
    (a system prompt) or nothing are dropped."""
    owner: dict[tuple, int] = {}
    linked: set[int] = set()
    for i, r in enumerate(rows):
        h = r["hash_ids"]
        for n in range(len(h), min_shared - 1, -1):
            j = owner.get(tuple(h[:n]))
            if j is not None:
                linked.update((i, j))
                break
        for n in range(min_shared, len(h) + 1):
            owner.setdefault(tuple(h[:n]), i)
    return [rows[i] for i in sorted(linked)]


def trace_rows(n: int, window: int = 0, min_shared: int = 2, path: Path = TRACE) -> list[dict]:
    """The first n rows of the trace or, with a window, the first n of multi_turn_rows(first `window` rows)."""
    rows = []
    with path.open() as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) >= (window or n):
                break
    return multi_turn_rows(rows, min_shared)[:n] if window else rows[:n]


def trace_workload(words: Words, n: int, compression: float, osl_scale: float, window: int = 0, min_shared: int = 2,
                   path: Path = TRACE) -> list[dict]:
    """The slice's rows (trace_rows) with their text: each hash id's block of words, cut to the row's input length."""
    rows = trace_rows(n, window, min_shared, path)
    t0 = rows[0]["timestamp"]
    blocks: dict[int, list[str]] = {}
    out = []
    for r in rows:
        ws: list[str] = []
        for h in r["hash_ids"]:
            if h not in blocks:
                blocks[h] = words.block(h)
            ws.extend(blocks[h])
        out.append({"t": (r["timestamp"] - t0) / 1000.0 / compression, "text": "".join(ws[: r["input_length"]]),
                    "max_tokens": max(1, math.ceil(r["output_length"] * osl_scale))})
    return out


def chat_body(text: str, max_tokens: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}


# ---------------------------------------------------------------- load

async def open_loop(url: str, workload: list[dict]) -> tuple[list[RequestResult], float]:
    """Request i is sent at t0 + t_i (wall), whatever is in flight."""
    results: list[RequestResult | None] = [None] * len(workload)
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def fire(i: int, w: dict) -> None:
            delay = t0 + w["t"] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            results[i] = await _one(client, url + "/v1/chat/completions", chat_body(w["text"], w["max_tokens"]))

        await asyncio.gather(*(fire(i, w) for i, w in enumerate(workload)))
        return results, time.perf_counter() - t0  # type: ignore[return-value]


async def closed_loop(url: str, bodies: list[dict], concurrency: int) -> tuple[list[RequestResult], float]:
    results: list[RequestResult] = []
    it = iter(bodies)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def worker() -> None:
            for b in it:
                results.append(await _one(client, url + "/v1/chat/completions", b))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


async def loadgen_run(load) -> dict:
    t0 = time.time()
    results, wall = await load
    return summarize(results, wall) | {"window": (t0, time.time())}


def aiperf_summary(export: dict) -> dict:
    """aiperf's profile_export_aiperf.json as the same summary `summarize` gives (wall ms, tokens/s)."""
    def q(name: str) -> dict:
        m = export.get(name) or {}
        return {k: (round(m[k], 3) if m.get(k) is not None else None) for k in ("p50", "p90", "p99")} | \
               {"mean": round(m["avg"], 3) if m.get("avg") is not None else None}

    ok = int((export.get("request_count") or {}).get("avg") or 0)
    errors = int((export.get("error_request_count") or {}).get("avg") or 0)
    tokens = int((export.get("total_output_tokens") or {}).get("avg") or 0)
    gaps = int((export.get("inter_chunk_latency") or {}).get("count") or 0)
    wall = float((export.get("benchmark_duration") or {}).get("avg") or 0.0)
    return {"requests": ok + errors, "ok": ok, "errors": errors,
            "error_samples": [str(e)[:200] for e in (export.get("error_summary") or [])[:3]],
            "wall_s": round(wall, 2), "output_tokens": tokens,
            "prompt_tokens": int((export.get("total_isl") or {}).get("avg") or 0),
            "ttft_ms": q("time_to_first_token"), "itl_ms": q("inter_chunk_latency"),
            "output_tok_per_s": round((export.get("output_token_throughput") or {}).get("avg") or 0.0, 1),
            "tokens_per_chunk": round(tokens / (gaps + ok), 3) if gaps + ok else None}


def aiperf_trace(n: int, compression: float, osl_scale: float, window: int, min_shared: int, path: Path = TRACE) -> str:
    """The trace slice (trace_rows) as a Mooncake jsonl for aiperf: timestamps from 0 in ms / compression, outputs scaled."""
    rows = trace_rows(n, window, min_shared, path)
    t0 = rows[0]["timestamp"]
    return "".join(json.dumps({"timestamp": int((r["timestamp"] - t0) / compression), "input_length": r["input_length"],
                               "output_length": max(1, math.ceil(r["output_length"] * osl_scale)),
                               "hash_ids": r["hash_ids"]}) + "\n" for r in rows)


def aiperf_home(tmp: Path) -> Path:
    """The sim's tokenizer laid out as a Hugging Face cache entry `local/cl100k` (aiperf resolves a tokenizer
    through the hub API even offline; a plain folder path fails with HF_HUB_OFFLINE=1)."""
    home = tmp / "hf"
    snap = home / "hub" / "models--local--cl100k" / "snapshots" / ("0" * 40)
    if not snap.is_dir():
        snap.mkdir(parents=True)
        (home / "hub" / "models--local--cl100k" / "refs").mkdir()
        (home / "hub" / "models--local--cl100k" / "refs" / "main").write_text("0" * 40)
        for f in SIM_TOKENIZER.iterdir():
            shutil.copy(f, snap / f.name)
    return home


async def aiperf_run(url: str, tmp: Path, tag: str, load_args: list[str]) -> dict:
    """One `aiperf profile` (streaming chat, server token counts, ignore_eos) against url; its summary."""
    art = tmp / f"aiperf-{tag}-{uuid.uuid4().hex[:4]}"
    env = {**os.environ, "HF_HOME": str(aiperf_home(tmp)), "HF_HUB_OFFLINE": "1"}
    cmd = [str(ROOT / ".venv-aiperf" / "bin" / "aiperf"), "profile", "--model", MODEL, "--url", url, "--endpoint-type",
           "chat", "--streaming", "--tokenizer", "local/cl100k", "--use-server-token-count", "--extra-inputs",
           "ignore_eos:true", "--ui", "none", "--no-server-metrics", "--artifact-dir", str(art), *load_args]
    with open(tmp / f"aiperf-{tag}.log", "wb") as log:
        proc = await asyncio.create_subprocess_exec(*cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
        rc = await proc.wait()
    export = art / "profile_export_aiperf.json"
    if rc != 0 or not export.exists():
        raise RuntimeError(f"aiperf failed (rc {rc}); log {tmp / f'aiperf-{tag}.log'}")
    data = json.loads(export.read_text())
    window = tuple(datetime.fromisoformat(data[k]).timestamp() for k in ("start_time", "end_time"))  # local time
    return aiperf_summary(data) | {"window": window}


# ---------------------------------------------------------------- engines

class Fleet:
    """--engines sim engines from this checkout, each with its KV-event PUB and replay sockets."""

    def __init__(self, args, speedup: float, tmp: Path, tag: str) -> None:
        from workers.process import EngineProcess
        from workers.registry import get_backend
        from workers.types import EngineLaunchConfig

        self.engines = []
        d = tmp / tag
        d.mkdir(parents=True, exist_ok=True)
        for i in range(args.engines):
            cfg = EngineLaunchConfig(
                model="h200-llama3.1-8b", served_model_name=MODEL, port=args.base_port + i, block_size=16,
                max_model_len=args.max_model_len, kv_events_endpoint=f"ipc://{d}/kv{i}.sock",
                kv_replay_endpoint=f"ipc://{d}/replay{i}.sock",
                extra_args=["--speedup", str(speedup), "--num-gpu-blocks", str(args.num_gpu_blocks)])
            self.engines.append((cfg, EngineProcess(get_backend("sim"), cfg, d / f"engine{i}.log")))

    @property
    def urls(self) -> list[str]:
        return [p.url for _, p in self.engines]

    async def __aenter__(self) -> "Fleet":
        for _, p in self.engines:
            p.start()
        await asyncio.gather(*(p.wait_healthy(120) for _, p in self.engines))
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.gather(*(p.stop() for _, p in self.engines))

    async def counters(self) -> dict:
        tot = {"hits": 0.0, "queries": 0.0}
        async with httpx.AsyncClient(timeout=10) as c:
            for url in self.urls:
                for name, val in METRIC_RE.findall((await c.get(url + "/metrics")).text):
                    tot["hits" if "hits" in name else "queries"] += float(val)
        return tot


# ---------------------------------------------------------------- routers

class Router:
    """One router process (own session), started in front of a fleet; stopped by its PID (SIGTERM, then SIGKILL
    of its process group)."""

    def __init__(self, label: str, args, fleet: Fleet, tmp: Path) -> None:
        self.label, self.args, self.fleet, self.tmp = label, args, fleet, tmp
        self.port = args.router_port
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.disc = None
        self.prefix = f"kvyard-rc-{uuid.uuid4().hex[:6]}"

    def command(self) -> tuple[list[str], dict, Path]:
        a, urls, env = self.args, self.fleet.urls, dict(os.environ)
        if self.label.startswith("kvyard"):
            tree = Path(a.baseline) if "baseline" in self.label else ROOT
            policy = "kv" if self.label.endswith("-kv") else "round-robin"
            env["PYTHONPATH"] = str(tree)
            return ([sys.executable, "-m", "orchestrator", "--log-level", "warning", "frontend", "--port", str(self.port),
                     "--grpc-port", "0", "--policy", policy, "--redis-url", a.redis_url, "--discovery-prefix", self.prefix],
                    env, tree)
        policy = "cache_aware" if self.label.endswith("-ca") else "round_robin"
        common = ["--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *urls, "--policy", policy,
                  "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.port + 1)]
        if self.label.startswith("vllm-router"):
            return [str(ROOT / ".venv-vllm-router" / "bin" / "vllm-router"), *common, "--log-level", "warning"], env, ROOT
        return [str(ROOT / ".venv-sglang-router" / "bin" / "smg"), "launch", *common, "--log-level", "warn"], env, ROOT

    async def __aenter__(self) -> "Router":
        if self.label.startswith("kvyard"):
            await self.register()
        cmd, env, cwd = self.command()
        self.log = self.tmp / f"{self.label}-{uuid.uuid4().hex[:4]}.log"
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 90
        async with httpx.AsyncClient(timeout=30) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.label} exited: {self.log.read_text()[-2000:]}")
                if await self.ready(c):
                    return self
                await asyncio.sleep(0.5)
        await self.__aexit__()
        raise RuntimeError(f"{self.label} not ready; log {self.log}")

    async def ready(self, c: httpx.AsyncClient) -> bool:
        try:
            if self.label.startswith("kvyard"):
                cl = (await c.get(self.url + "/api/cluster")).json()
                if sum(w["state"] == "ready" for w in cl["workers"]) < len(self.fleet.urls):
                    return False
            r = await c.post(self.url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                                     "messages": [{"role": "user", "content": "hello"}]})
            return r.status_code == 200
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return False

    async def register(self) -> None:
        from workers.discovery import RedisDiscovery
        from workers.types import WorkerInfo

        self.disc = RedisDiscovery(self.args.redis_url, prefix=self.prefix)
        for i, (cfg, p) in enumerate(self.fleet.engines):
            await self.disc.register(WorkerInfo(
                worker_id=f"sim-{i}", model=MODEL, backend="sim", url=p.url, block_size=16, max_model_len=cfg.max_model_len,
                tokenizer=str(SIM_TOKENIZER), kv_events_endpoint=cfg.kv_events_endpoint,
                kv_replay_endpoint=cfg.kv_replay_endpoint, kv_events_topic=cfg.kv_events_topic), ttl_s=3600)

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.proc.pid) if self.proc else 0.0

    async def __aexit__(self, *exc) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            await reap_group(p)
        if self.disc is not None:
            for i in range(len(self.fleet.engines)):
                await self.disc.deregister(f"sim-{i}")
            await self.disc.close()
            self.disc = None


async def measure(router: Router, fleet: Fleet, run) -> dict:
    """Counters before; the load, with the router's CPU sampled every 0.2 s throughout; counters after. The router's
    CPU is counted over the load's own window (the client's first send to its last answer: for aiperf, its
    start_time..end_time, so aiperf's start-up and shut-down are left out)."""
    await asyncio.sleep(0.5)
    c0, la0 = await fleet.counters(), os.getloadavg()[0]
    chunks0 = await prompt_chunks(router)
    samples: list[tuple[float, float]] = []

    async def sample() -> None:
        while True:
            samples.append((time.time(), router.cpu_seconds()))
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample())
    box0 = box_cpu(Path("/proc/stat").read_text())
    try:
        s = await run()
    finally:
        samples.append((time.time(), router.cpu_seconds()))
        sampler.cancel()
    box1 = box_cpu(Path("/proc/stat").read_text())
    t0, t1 = s.pop("window")
    cpu0, cpu1 = 0.0, cpu_in_window(samples, t0, t1)
    await asyncio.sleep(1.0)  # the engines' last metrics
    c1 = await fleet.counters()
    dh, dq = c1["hits"] - c0["hits"], c1["queries"] - c0["queries"]
    s.update(cost_row(s, cpu1 - cpu0))
    chunks1 = await prompt_chunks(router)
    if chunks1:  # kvyard: where long prompts' chunk ids came from over the run
        s["prompt_chunks"] = {k: v - chunks0.get(k, 0) for k, v in chunks1.items()}
    s.update({"hit_rate": round(dh / dq, 4) if dq else None, "cache_hit_tokens": dh, "cache_query_tokens": dq,
              "loadavg_start": round(la0, 2), "loadavg_end": round(os.getloadavg()[0], 2),
              "box_cpu_busy": busy_share(box0, box1)})
    print(f"  {router.label}: ok {s['ok']}/{s['requests']} TTFT p50/p90 {s['ttft_ms']['p50']}/{s['ttft_ms']['p90']} ms, "
          f"{s['output_tok_per_s']} tok/s, hit {s['hit_rate']}, CPU {s['cpu_s']} s ({s['cpu_ms_per_request']} ms/req, "
          f"{s['cpu_s_per_1k_tokens']} s/1k tok), {s['tokens_per_chunk']} tok/chunk, wall {s['wall_s']} s, box busy {s['box_cpu_busy']}", flush=True)
    return s


async def prompt_chunks(router: Router) -> dict[str, float]:
    """kvyard's kvyard_prompt_chunks_total by source, and kvyard_prompt_learn_refused_total as "refused" (outside the
    CPU window); {} for the peers and for trees without them."""
    if not router.label.startswith("kvyard"):
        return {}
    async with httpx.AsyncClient(timeout=10) as c:
        text = (await c.get(router.url + "/metrics")).text
    out = {}
    for ln in text.splitlines():
        if ln.startswith('kvyard_prompt_chunks_total{source="'):
            out[ln.split('"')[1]] = float(ln.rsplit(" ", 1)[1])
        elif ln.startswith("kvyard_prompt_learn_refused_total "):
            out["refused"] = float(ln.rsplit(" ", 1)[1])
    return out


async def warm(router: Router) -> None:
    """A few short streams, then one long prompt of its own text (~30k characters, that no workload sends), so
    first-request costs (connections, tokenizer load, the long prompts' chunk cache and its checks) stay out of the
    measurement."""
    bodies = [chat_body(f"warm up {i}", 8) for i in range(8)]
    await closed_loop(router.url, bodies, 4)
    await closed_loop(router.url, [chat_body("".join(f"Warm-up line {i} of a long prompt.\n" for i in range(1000)), 2)], 1)
    await asyncio.sleep(1.0)  # what the frontend does after the answer (learning its ids) ends before the window


# ---------------------------------------------------------------- main

def check_baseline(path: Path) -> None:
    if not (path / "orchestrator").is_dir():
        raise SystemExit(f"--baseline {path}: not a kvyard checkout (no orchestrator/)")
    if not list((path / "router").glob("_kvcore*.so")):
        for so in (ROOT / "router").glob("_kvcore*.so"):
            shutil.copy(so, path / "router" / so.name)
            print(f"copied {so.name} into {path / 'router'}", flush=True)


async def amain(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvyard-rc-"))
    words = Words()
    out: dict = {"benchmark": "routers_compare", "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "machine": f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}", "command": args.command,
                 "client": ("aiperf 0.13.0 (--use-server-token-count), one process per run" if args.client == "aiperf"
                            else "benchmarks/loadgen.py streaming reader (httpx), in the benchmark process"),
                 "engines": args.engines, "num_gpu_blocks": args.num_gpu_blocks, "baseline": args.baseline,
                 "versions": {"vllm-router": "0.1.17", "sglang-router": "0.3.2"}, "workloads": {}}
    keep = lambda names: [r for r in names.split(",") if r and ("baseline" not in r or args.baseline)]  # noqa: E731

    if "trace" not in args.skip:
        wl = trace_workload(words, args.trace_requests, args.compression, args.osl_scale, args.trace_window,
                            args.min_shared_blocks)
        isl = [w["text"].count(" ") for w in wl]
        sec = {"requests": len(wl), "window": args.trace_window, "min_shared_blocks": args.min_shared_blocks,
               "compression": args.compression, "speedup": args.trace_speedup,
               "osl_scale": args.osl_scale, "isl_mean": round(float(np.mean(isl))), "isl_max": int(max(isl)),
               "span_s": round(wl[-1]["t"], 1), "runs": {}}
        print(f"[trace] {len(wl)} requests over {sec['span_s']} s, ISL mean {sec['isl_mean']}", flush=True)
        trace_file = tmp / "trace.jsonl"  # the same slice for aiperf: its own prompts from the hash ids, on this schedule
        trace_file.write_text(aiperf_trace(args.trace_requests, args.compression, args.osl_scale, args.trace_window,
                                           args.min_shared_blocks))
        for label in keep(args.trace_routers):
            async with Fleet(args, args.trace_speedup, tmp, f"trace-{label}") as fleet:
                async with Router(label, args, fleet, tmp) as router:
                    await warm(router)
                    if args.client == "aiperf":
                        run = lambda: aiperf_run(router.url, tmp, label, ["--custom-dataset-type", "mooncake_trace",  # noqa: E731
                                                                         "--input-file", str(trace_file)])
                    else:
                        run = lambda: loadgen_run(open_loop(router.url, wl))  # noqa: E731
                    sec["runs"][label] = await measure(router, fleet, run)
        sec["ratios"] = {m: ratios(sec["runs"], m, [p for p in sec["runs"] if not p.startswith("kvyard")])
                         for m in sec["runs"] if m.startswith("kvyard")}
        out["workloads"]["trace"] = sec

    if "stream" not in args.skip:
        levels = [int(x) for x in args.concurrency.split(",")]
        speedups = [float(x) for x in args.stream_speedup.split(",")]
        speedups += speedups[-1:] * (len(levels) - len(speedups))
        counts = [int(x) for x in args.stream_requests.split(",")] if args.stream_requests else [2 * c for c in levels]
        counts += counts[-1:] * (len(levels) - len(counts))
        sec = {"isl": args.stream_isl, "osl": args.stream_osl, "levels": {}}
        for conc, speedup, n in zip(levels, speedups, counts):
            runs = {}
            print(f"[stream c{conc}] {n} requests, engines at speed-up {speedup:g}", flush=True)
            async with Fleet(args, speedup, tmp, f"stream-{conc}") as fleet:
                for k, label in enumerate(keep(args.stream_routers)):
                    # distinct prompts per router: the fleet is shared, so no router reads another's cached prompts
                    bodies = [chat_body(words.text(args.stream_isl, (k * 1000 + conc) * 100000 + i), args.stream_osl)
                              for i in range(n)]
                    async with Router(label, args, fleet, tmp) as router:
                        await warm(router)
                        if args.client == "aiperf":
                            run = lambda: aiperf_run(router.url, tmp, f"{label}-c{conc}", [  # noqa: E731
                                "--isl", str(args.stream_isl), "--isl-stddev", "0", "--osl", str(args.stream_osl),
                                "--osl-stddev", "0", "--concurrency", str(conc), "--request-count", str(n),
                                "--random-seed", str(k * 1000 + conc)])
                        else:
                            run = lambda: loadgen_run(closed_loop(router.url, bodies, conc))  # noqa: E731
                        runs[label] = await measure(router, fleet, run)
            sec["levels"][str(conc)] = {"requests": n, "speedup": speedup, "runs": runs,
                                        "ratios": {m: ratios(runs, m, [p for p in runs if not p.startswith("kvyard")])
                                                   for m in runs if m.startswith("kvyard")}}
        out["workloads"]["stream"] = sec
    out["loadavg_end"] = round(os.getloadavg()[0], 2)
    shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---------------------------------------------------------------- report

def _f(v, nd=1):
    if v is None:
        return "–"
    return f"{v:,.{nd}f}"


def table(runs: dict) -> list[str]:
    lines = ["| router | ok | TTFT p50 (ms) | TTFT p90 (ms) | output tok/s | tok/chunk | prompt cache hits | router CPU-s | "
             "CPU ms / request | CPU-s / 1k out tok | out tok / CPU-s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in runs.items():
        hit = f"{r['hit_rate'] * 100:.1f}%" if r.get("hit_rate") is not None else "–"
        lines.append(f"| {label} | {r['ok']}/{r['requests']} | {_f(r['ttft_ms']['p50'])} | {_f(r['ttft_ms']['p90'])} | "
                     f"{_f(r['output_tok_per_s'])} | {_f(r['tokens_per_chunk'], 2)} | {hit} | {_f(r['cpu_s'], 2)} | "
                     f"{_f(r['cpu_ms_per_request'], 2)} | {_f(r['cpu_s_per_1k_tokens'], 3)} | {_f(r['tokens_per_cpu_s'], 0)} |")
    return lines


def ratio_table(rat: dict) -> list[str]:
    lines = ["| kvyard / peer | TTFT p50 | TTFT p90 | output tok/s | cache hits | CPU / request | CPU / 1k tok |",
             "|---|---|---|---|---|---|---|"]
    for mine, peers in rat.items():
        for peer, r in peers.items():
            lines.append(f"| {mine} / {peer} | " + " | ".join(_f(r[k], 2) for k in
                         ("ttft_p50", "ttft_p90", "output_tok_per_s", "hit_rate", "cpu_ms_per_request", "cpu_s_per_1k_tokens")) + " |")
    return lines


def write_report(out: dict, name: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2) + "\n")
    md = [f"# Routers side by side ({out['when']}, {out['machine']})", "", f"    {out['command']}", "",
          f"{out['engines']} sim engines (H200 Llama-3.1-8B-FP8 profile, {out['num_gpu_blocks']} KV blocks of 16 tokens each), "
          f"the same for every router; client: {out['client']}. Router CPU = utime+stime of the router process (all "
          "threads) and its descendants, from /proc, over the load. Latencies and throughput in wall time.", ""]
    wl = out["workloads"]
    if "trace" in wl:
        t = wl["trace"]
        if not t.get("window"):
            sl = f"the first {t['requests']}"
        elif t["min_shared_blocks"]:
            sl = (f"the {t['requests']} multi-turn rows (≥ {t['min_shared_blocks']} leading 512-token blocks shared with "
                  f"another row) of the first {t['window']:,}")
        else:
            sl = f"the {t['requests']} rows (shared leading blocks or not) of the first {t['window']:,}"
        md += [f"## Trace: {sl} Mooncake conversation requests (ISL mean {t['isl_mean']:,}, max "
               f"{t['isl_max']:,} tokens; shared prefixes), {t['span_s']} s open loop (trace time / {t['compression']:g}), "
               f"engines at speed-up {t['speedup']:g}, OSL × {t['osl_scale']:g}", ""]
        md += table(t["runs"]) + [""] + ratio_table(t["ratios"]) + [""]
        known = {k: r["prompt_chunks"] for k, r in t["runs"].items() if r.get("prompt_chunks")}
        if known:
            md += ["Long prompts' chunks (kvyard's `kvyard_prompt_chunks`), by where their ids came from:", "",
                   "| router | from the cache | tokenized | learned from the engine | engine answers refused |", "|---|---|---|---|---|"]
            md += [f"| {k} | {c.get('cached', 0):,.0f} | {c.get('tokenized', 0):,.0f} | {c.get('learned', 0):,.0f} | "
                   f"{c.get('refused', 0):,.0f} |" for k, c in known.items()] + [""]
    if "stream" in wl:
        s = wl["stream"]
        for conc, lv in s["levels"].items():
            md += [f"## Stream: {s['isl']}-token prompts, {s['osl']} output tokens, concurrency {conc}, {lv['requests']} "
                   f"requests, engines at speed-up {lv['speedup']:g}", ""]
            md += table(lv["runs"]) + [""] + ratio_table(lv["ratios"]) + [""]
    (RESULTS / f"{name}.md").write_text("\n".join(md))
    print("\n".join(md))


def plot(out: dict, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    wl = out["workloads"]
    if "trace" in wl:
        panels.append(("trace", wl["trace"]["runs"]))
    for conc, lv in wl.get("stream", {}).get("levels", {}).items():
        panels.append((f"stream c{conc}", lv["runs"]))
    if not panels:
        return
    fig, axes = plt.subplots(3, len(panels), figsize=(4.2 * len(panels), 9), squeeze=False)
    colors = {"kvyard": "tab:blue", "vllm": "tab:orange", "sglang": "tab:green"}
    for j, (title, runs) in enumerate(panels):
        labels = list(runs)
        cols = [("tab:purple" if "baseline" in lb else colors[lb.split("-")[0]]) for lb in labels]
        for i, (key, ylabel) in enumerate([("cpu_ms_per_request", "router CPU ms / request"),
                                           ("cpu_s_per_1k_tokens", "router CPU-s / 1k output tokens"),
                                           ("ttft_p50", "TTFT p50 / p90 (ms)")]):
            ax = axes[i][j]
            if key == "ttft_p50":
                ax.bar(labels, [runs[lb]["ttft_ms"]["p90"] or 0 for lb in labels], color=cols, alpha=0.35, label="p90")
                ax.bar(labels, [runs[lb]["ttft_ms"]["p50"] or 0 for lb in labels], color=cols, label="p50")
            else:
                ax.bar(labels, [runs[lb][key] or 0 for lb in labels], color=cols)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.tick_params(axis="x", labelrotation=45, labelsize=7)
            if i == 0:
                ax.set_title(title)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 engines, 40 trace requests, 16 streams at concurrency 16, 4 routers")
    ap.add_argument("--baseline", default=None, help="another kvyard checkout, run as kvyard-baseline-*")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--num-gpu-blocks", type=int, default=16384, help="KV blocks per engine")
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--base-port", type=int, default=19700, help="engines listen from here")
    ap.add_argument("--router-port", type=int, default=19690, help="the router under test (+1: its Prometheus port)")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--trace-requests", type=int, default=400, help="at most this many trace rows")
    ap.add_argument("--trace-window", type=int, default=1000,
                    help="take the multi-turn rows of the trace's first N rows (0: the first --trace-requests rows)")
    ap.add_argument("--min-shared-blocks", type=int, default=2, help="multi-turn: leading 512-token blocks shared")
    ap.add_argument("--compression", type=float, default=8.0, help="trace time / wall time")
    ap.add_argument("--osl-scale", type=float, default=0.25)
    ap.add_argument("--trace-speedup", type=float, default=1.0)
    ap.add_argument("--trace-routers", default=DEFAULT_TRACE_ROUTERS)
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--stream-requests", default="128,256",
                    help="requests per concurrency level (the last repeats; empty: 2 × concurrency)")
    ap.add_argument("--stream-isl", type=int, default=64)
    ap.add_argument("--stream-osl", type=int, default=512)
    ap.add_argument("--stream-speedup", default="0.2,0.1",
                    help="engine speed-up per concurrency level (a fresh fleet per level; the last repeats)")
    ap.add_argument("--stream-routers", default=DEFAULT_STREAM_ROUTERS)
    ap.add_argument("--skip", default="", help="comma list of: trace, stream")
    ap.add_argument("--client", choices=["aiperf", "loadgen"], default="aiperf",
                    help="aiperf 0.13.0 (.venv-aiperf; its own prompts from the same trace rows / ISL, OSL) or "
                         "benchmarks/loadgen.py's reader in this process")
    ap.add_argument("--out", default="routers_compare")
    return ap


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.command = "benchmarks/routers_compare.py " + " ".join(argv)
    if args.quick:
        args.trace_requests, args.concurrency, args.stream_requests, args.engines = 40, "16", "16", 4
        if args.trace_routers == DEFAULT_TRACE_ROUTERS:
            args.trace_routers = "kvyard-kv,kvyard-baseline-kv,vllm-router-ca,sglang-ca"
        if args.out == "routers_compare":
            args.out = "routers_compare_quick"
    if args.baseline:
        args.baseline = str(Path(args.baseline).resolve())
        check_baseline(Path(args.baseline))
    need = [(".venv-vllm-router", "vllm-router"), (".venv-sglang-router", "smg")]
    for venv, exe in need + ([(".venv-aiperf", "aiperf")] if args.client == "aiperf" else []):
        if not (ROOT / venv / "bin" / exe).exists():
            raise SystemExit(f"{ROOT / venv} missing: run scripts/install_routers.sh")
    signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM stops the run through the same clean-up as Ctrl-C
    out = asyncio.run(amain(args))
    write_report(out, args.out)
    plot(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
