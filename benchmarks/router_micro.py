"""Router micro-benchmarks: one routing decision, and KV-event ingest, on one core.

Decision: `Router("kv").route()` for a 4,096-token prompt (block size 16: 256 blocks) over 64
endpoints whose index holds ~1M blocks (64 workers x 244 cached 1,024-token sequences), with
background load booked on every worker. Timed end to end through Router.route (hash the prompt,
match it in the index, cost every endpoint, rank, book), wall clock, each request with a fresh
list of token ids (as the tokenizer hands it over), for three prompt kinds:
    miss      no block of the prompt is cached anywhere
    half      its first 2,048 tokens are cached on 4 workers
    full      all 4,096 tokens are cached on 8 workers (the longest walk)
plus the parts alone (hash, match, score) for the `half` prompts. Each run is preceded by a
warm-up; GC stays on (setup objects frozen, as a long-running frontend's would be old).

Ingest: BlockStored events of 16 blocks (256 tokens) into the index until 1M blocks (blocks/s),
BlockRemoved of a quarter of them, the apply rate for 1, 16 and 128 blocks per event, and
decode + apply of the same events from vLLM's and SGLang's msgpack wire bytes (the decoders are
the backends' own: workers/vllm, workers/sglang).

    .venv/bin/python benchmarks/router_micro.py [--queries 2000] [--rounds 5] [--cpu 0]

Writes benchmarks/results/router_micro.json. The machine is shared (2 cores): decisions are timed
in rounds and both all samples and the quietest round are reported, with the load average
before and after; rerun when it is high.
"""

from __future__ import annotations

import argparse
import gc
from array import array
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from router import Endpoint, KvIndex, RouteRequest, Router, build_policy  # noqa: E402
from router.hashing import block_hashes_view  # noqa: E402
from router import _kernels, hashing  # noqa: E402
from workers.kv_events import BlockRemoved, BlockStored  # noqa: E402
from workers.sglang import kv_events as sglang  # noqa: E402
from workers.vllm import kv_events as vllm  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BS, WORKERS, SEQ_TOKENS, PROMPT = 16, 64, 1024, 4096


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(ns: list[int]) -> dict:
    us = [x / 1000 for x in ns]
    return {"p50_us": round(pct(us, 0.5), 2), "p90_us": round(pct(us, 0.9), 2), "p99_us": round(pct(us, 0.99), 2),
            "mean_us": round(statistics.fmean(us), 2), "n": len(us)}


def build_index(rng: random.Random, target_blocks: int) -> tuple[KvIndex, list[list[int]], dict]:
    """Index ~target_blocks blocks over WORKERS workers through BlockStored events; time it."""
    ix = KvIndex()
    for w in range(WORKERS):
        ix.add_worker(f"w{w}", block_size=BS)
    per_seq = SEQ_TOKENS // BS
    nseq = target_blocks // per_seq
    seqs = [[rng.randrange(50_000) for _ in range(SEQ_TOKENS)] for _ in range(nseq)]
    events = []  # 16-block events chained through the sequence, as an engine publishes them
    eid = 0
    for i, toks in enumerate(seqs):
        parent = None
        for k in range(0, per_seq, 16):
            ids = list(range(eid, eid + 16))
            eid += 16
            events.append((f"w{i % WORKERS}", BlockStored(ids, parent, toks[k * BS:(k + 16) * BS], BS)))
            parent = ids[-1]
    gc.collect()
    t0 = time.perf_counter()
    for wid, ev in events:
        ix.apply(wid, ev)
    store_s = time.perf_counter() - t0
    blocks = sum(len(ev.block_hashes) for _, ev in events)
    return ix, seqs, {"events": len(events), "blocks": blocks, "store_blocks_per_s": round(blocks / store_s),
                      "blocks_per_event": 16, "index_entries": len(ix), "table_bytes": ix.nbytes, "_events": events}


def bench_ingest_wire(events: list, n_events: int) -> dict:
    """Decode + apply from wire bytes (vLLM 0.32 maps; SGLang signed ids) into a fresh index."""
    out = {}
    sample = events[:n_events]
    for name, codec, enc in (("vllm", vllm, lambda ev: vllm.encode_batch(1.0, [ev])), ("sglang", sglang, lambda ev: sglang.encode_batch(1.0, [ev]))):
        payloads = [(wid, enc(ev)) for wid, ev in sample]
        ix = KvIndex()
        t0 = time.perf_counter()
        for wid, p in payloads:
            ix.apply_batch(wid, codec.decode_payload(p).events)
        dt = time.perf_counter() - t0
        out[f"{name}_decode_and_apply_blocks_per_s"] = round(16 * len(payloads) / dt)
    return out


def bench_event_sizes(rng: random.Random, total_blocks: int = 200_000) -> dict:
    """Index apply rate (blocks/s) by blocks per BlockStored event: 1 is a decode step's new block,
    128+ a long prefill's; per-event overhead is what separates them."""
    out = {}
    for per in (1, 16, 128):
        events, eid = [], 0
        for i in range(total_blocks // per):
            toks = [rng.randrange(50_000) for _ in range(per * BS)]
            events.append((f"w{i % WORKERS}", BlockStored(list(range(eid, eid + per)), None, toks, BS)))
            eid += per
        ix = KvIndex()
        gc.collect()
        t0 = time.perf_counter()
        for wid, ev in events:
            ix.apply(wid, ev)
        out[f"store_blocks_per_s_{per}_per_event"] = round(per * len(events) / (time.perf_counter() - t0))
    return out


def bench_route(router: Router, endpoints: list[Endpoint], prompts: list[list[int]], n: int, rounds: int) -> dict:
    """`rounds` rounds of n decisions: all samples, and the quietest round (lowest p50) on its own,
    since other processes on this shared 2-core machine come and go."""
    per_round = []
    for r in range(rounds):
        times = []
        for k in range(n + 100):
            # a fresh list of fresh ints per request, as the tokenizer hands it over (not timed)
            rq = RouteRequest(request_id=f"q{r}-{k}", model="m", token_ids=prompts[k % len(prompts)].tolist())
            t0 = time.perf_counter_ns()
            router.route(rq, endpoints)
            dt = time.perf_counter_ns() - t0
            router.on_complete(rq.request_id)
            if k >= 100:
                times.append(dt)
        per_round.append(times)
    quietest = min(per_round, key=lambda ts: pct(ts, 0.5))
    return {"all": summary([t for ts in per_round for t in ts]), "quietest_round": summary(quietest),
            "round_p50s_us": [round(pct(ts, 0.5) / 1000, 1) for ts in per_round]}


def bench_parts(router: Router, endpoints: list[Endpoint], prompts: list[list[int]], n: int) -> dict:
    ix = router.kv_index
    scorer = router.policy.scorers[0][0]
    th, tm, ts = [], [], []
    for k in range(n):
        toks = prompts[k % len(prompts)].tolist()
        t0 = time.perf_counter_ns()
        h = block_hashes_view(toks, BS)  # what Router.route uses
        t1 = time.perf_counter_ns()
        ov = ix.find_matches(h)
        t2 = time.perf_counter_ns()
        rq = RouteRequest("p", "m", toks, block_hashes=h, hashed_block_size=BS, overlap_blocks=ov)
        t3 = time.perf_counter_ns()
        scorer.score(rq, endpoints)
        t4 = time.perf_counter_ns()
        th.append(t1 - t0)
        tm.append(t2 - t1)
        ts.append(t4 - t3)
    return {"hash_4096_tokens": summary(th), "find_matches": summary(tm), "kv_cost_64_endpoints": summary(ts)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queries", type=int, default=2000, help="decisions per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--cpu", type=int, default=0, help="pin to this core (-1: do not pin)")
    ap.add_argument("--out", default=str(RESULTS / "router_micro.json"))
    args = ap.parse_args()
    if args.cpu >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    load_before = os.getloadavg()
    rng = random.Random(1234)

    ix, seqs, ingest = build_index(rng, args.blocks)
    events = ingest.pop("_events")
    removals = [(wid, BlockRemoved(ev.block_hashes)) for wid, ev in events[: len(events) // 4]]
    t0 = time.perf_counter()
    for wid, ev in removals:
        ix.apply(wid, ev)
    ingest["remove_blocks_per_s"] = round(16 * len(removals) / (time.perf_counter() - t0))
    for wid, ev in events[: len(events) // 4]:  # back to ~1M blocks
        ix.apply(wid, ev)
    ingest.update(bench_ingest_wire(events, 8000))
    ingest.update(bench_event_sizes(rng))

    router = Router(build_policy("kv", index=ix, seed=7))
    endpoints = [Endpoint(worker_id=f"w{w}", url=f"http://127.0.0.1:{8100 + w}", model="m", block_size=BS) for w in range(WORKERS)]
    for w, ep in enumerate(endpoints):  # background load: 0-5 running requests, some still in prefill
        for j in range(w % 6):
            router.loads.on_routed(f"bg{w}-{j}", ep.worker_id, rng.randrange(512, 4096), BS)
            if j % 2:
                router.loads.on_first_token(f"bg{w}-{j}")

    def prompts(kind: str) -> list[list[int]]:
        out = []
        for i in range(64):
            tail = [rng.randrange(50_000, 60_000) for _ in range(PROMPT)]
            if kind == "miss":
                out.append(tail)
            elif kind == "half":  # a 1,024-token cached sequence + its own next 1,024 tokens cached on 4 workers
                head = seqs[i] + seqs[i + 64]
                for w in range(4):
                    ix.store(f"w{(i + w * 16) % WORKERS}", [10**9 + i * 1000 + w * 100 + b for b in range(128)], None, head, BS)
                out.append(head + tail[: PROMPT - 2048])
            else:
                full = tail
                for w in range(8):
                    ix.store(f"w{(i + w * 8) % WORKERS}", [2 * 10**9 + i * 1000 + w * 300 + b for b in range(256)], None, full, BS)
                out.append(full)
        return out

    gc.collect()
    gc.freeze()
    kinds = {k: [array("I", p) for p in prompts(k)] for k in ("miss", "half", "full")}
    decision = {k: bench_route(router, endpoints, p, args.queries, args.rounds) for k, p in kinds.items()}
    parts = bench_parts(router, endpoints, kinds["half"], args.queries)
    result = {
        "what": "Router('kv').route(): 4,096-token prompt, block size 16, 64 endpoints, ~1M indexed blocks; one core",
        "target": {"decision_p50_us": 50, "decision_p99_us": 200, "ingest_blocks_per_s": 1_000_000},
        "decision": decision,
        "parts_half_prompt": parts,
        "ingest": ingest,
        "implementation": {"hashing": hashing.IMPLEMENTATION, "kernels": _kernels.IMPLEMENTATION},
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "pinned_core": args.cpu, "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("decision", "parts_half_prompt", "ingest", "machine")}, indent=1))


if __name__ == "__main__":
    main()
