"""Router micro-benchmarks: one routing decision, and KV-event ingest, on one core.

Decision: `Router("kv").route()` for a 4,096-token prompt (block size 16: 256 blocks) over 64
endpoints whose index holds ~1M blocks (64 workers x 244 cached 1,024-token sequences), with
background load booked on every worker. Timed end to end through Router.route (hash the prompt,
match it in the index, cost every endpoint, rank, book), wall clock, each request with a fresh
list of token ids (as the tokenizer hands it over), for three prompt kinds:
    miss      no block of the prompt is cached anywhere (fresh tokens per request)
    half      its first 2,048 tokens are cached on 4 workers (the rest fresh per request)
    full      all 4,096 tokens are cached on 8 workers (the longest walk)
The router keeps the frontend's load bookkeeping (prefill drain on, every worker with a measured prefill rate: its
queues drain at most every 2 ms of the run). Routing also records each request's new blocks as pending on its worker (predictions the engine's events confirm
later, router/kv_index.py): the fresh tokens keep every kind what it is, and the decisions run with the pending
table those requests fill (its size is reported).
then the decision as the issue defines it (hash + match + cost + rank, no booking) on the same prompts, and
the parts alone (hash, match, cost + rank) for the `half` prompts. Each run is preceded by a
warm-up; GC stays on (setup objects frozen, as a long-running frontend's would be old).

Ingest: BlockStored events of 16 blocks (256 tokens) into the index until 1M blocks (blocks/s),
BlockRemoved of a quarter of them, the apply rate for 1, 16 and 128 blocks per event, and
decode + apply of the same events from vLLM's and SGLang's msgpack wire bytes (the decoders are
the backends' own: workers/vllm, workers/sglang).

Then the same events and prompts go to NVIDIA Dynamo's Python RadixTree (`dynamo._core`, ai-dynamo-runtime
1.6.1): benchmarks/dynamo_radix_micro.py runs under Dynamo's venv on the same core, from a job file written
here (events, query-setup stores, prompts, and the overlaps kvyard's index reports for each prompt, which
Dynamo's find_matches must reproduce). Its figures go under `dynamo`, the ratios under `side_by_side`.
Dynamo's binding hands every call to a Rust background thread, so its timings include that hand-off and
are not the speed of its in-process indexer.

    .venv/bin/python benchmarks/router_micro.py [--queries 2000] [--rounds 5] [--cpu 0]
        [--dynamo-python .venv-dynamo/bin/python | --no-dynamo]

Writes benchmarks/results/router_micro.json and router_micro.md. The machine is shared (2 cores):
decisions are timed in rounds and both all samples and the quietest round are reported, with the load
average before and after; rerun when it is high.
"""

from __future__ import annotations

import argparse
import gc
from array import array
import json
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from router import Endpoint, KvIndex, RouteRequest, Router, build_policy  # noqa: E402
from router.hashing import block_hashes_view  # noqa: E402
from router.load import LoadTracker  # noqa: E402
from router import _kernels, hashing  # noqa: E402
from router.kv_events import BlockRemoved, BlockStored  # noqa: E402
from workers.sglang import kv_events as sglang  # noqa: E402
from workers.vllm import kv_events as vllm  # noqa: E402
from benchmarks.dynamo_radix_micro import pack_event, pct, summary  # noqa: E402 (one percentile rule for both sides)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
DYNAMO_SCRIPT = Path(__file__).resolve().parent / "dynamo_radix_micro.py"
DYNAMO_PYTHON = ROOT / ".venv-dynamo" / "bin" / "python"
TARGET = {"decision_p50_us": 50, "decision_p99_us": 200, "ingest_blocks_per_s": 1_000_000}
KINDS = ("miss", "half", "full")
BS, WORKERS, SEQ_TOKENS, PROMPT = 16, 64, 1024, 4096


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


def rounds_summary(per_round: list[list[int]]) -> dict:
    """Timings (ns) taken in rounds: all samples, the quietest round (lowest p50) on its own, and each round's p50,
    since other processes on this shared 2-core machine come and go."""
    quietest = min(per_round, key=lambda ts: pct(ts, 0.5))
    return {"all": summary([t for ts in per_round for t in ts]), "quietest_round": summary(quietest),
            "round_p50s_us": [round(pct(ts, 0.5) / 1000, 1) for ts in per_round]}


def _timed_rounds(prompts: list[list[int]], n: int, rounds: int, fresh_from: int | None, pool: array | None, one) -> dict:
    """`rounds` rounds of n timed calls `one(request_id, token_ids) -> ns` after 100 untimed ones, each given a
    fresh list of fresh ints (as the tokenizer hands it over; building it is not timed)."""
    per_round = []
    off = 0
    for r in range(rounds):
        times = []
        for k in range(n + 100):
            toks = prompts[k % len(prompts)].tolist()
            if fresh_from is not None:
                off += 1
                toks[fresh_from:] = pool[off: off + PROMPT - fresh_from].tolist()
            dt = one(f"q{r}-{k}", toks)
            if k >= 100:
                times.append(dt)
        per_round.append(times)
    return rounds_summary(per_round)


def bench_route(router: Router, endpoints: list[Endpoint], prompts: list[list[int]], n: int, rounds: int,
                fresh_from: int | None = None, pool: array | None = None) -> dict:
    """`rounds` rounds of n decisions: all samples, and the quietest round (lowest p50) on its own,
    since other processes on this shared 2-core machine come and go.

    Routing marks the blocks a request will store on its worker as pending (router/kv_index.py), so a prompt
    routed twice would be a hit the second time. With `fresh_from` every request's tokens from that position on
    are a window of `pool` no earlier request used (shifted by one token: every block differs), so a miss stays
    a miss and a half prompt stays half cached; the full prompts add nothing pending (their worker holds them)."""
    def one(rid: str, toks: list[int]) -> int:
        rq = RouteRequest(request_id=rid, model="m", token_ids=toks)
        t0 = time.perf_counter_ns()
        router.route(rq, endpoints)
        dt = time.perf_counter_ns() - t0
        router.on_complete(rid)
        return dt
    return _timed_rounds(prompts, n, rounds, fresh_from, pool, one)


def bench_core(router: Router, endpoints: list[Endpoint], prompts: list[list[int]], n: int, rounds: int,
               fresh_from: int | None = None, pool: array | None = None) -> dict:
    """The decision as the issue defines it, hash + match + cost (+ rank), without booking: what Router.route does
    before it charges the chosen worker (the load and the pending predictions, timed in bench_route). Same prompts
    and fresh tokens as bench_route; nothing is booked, so the index and the loads stay as they are."""
    ix = router.kv_index
    s = router.policy.scorers[0][0]
    rng = random.Random(11)

    def one(rid: str, toks: list[int]) -> int:
        t0 = time.perf_counter_ns()
        h = block_hashes_view(toks, BS)
        ov = ix.find_matches(h)
        _kernels.kv_rank(endpoints, ov, len(toks), BS, s.overlap_weight, s.reuse_weight, s.request_weight, rng.getrandbits(62))
        return time.perf_counter_ns() - t0
    return _timed_rounds(prompts, n, rounds, fresh_from, pool, one)


def bench_parts(router: Router, endpoints: list[Endpoint], prompts: list[list[int]], n: int) -> dict:
    ix = router.kv_index
    s = router.policy.scorers[0][0]
    th, tm, ts = [], [], []
    for k in range(n):
        toks = prompts[k % len(prompts)].tolist()
        t0 = time.perf_counter_ns()
        h = block_hashes_view(toks, BS)  # what Router.route uses
        t1 = time.perf_counter_ns()
        ov = ix.find_matches(h)
        t2 = time.perf_counter_ns()
        _kernels.kv_rank(endpoints, ov, len(toks), BS, s.overlap_weight, s.reuse_weight, s.request_weight, k)  # as Router.route
        t3 = time.perf_counter_ns()
        th.append(t1 - t0)
        tm.append(t2 - t1)
        ts.append(t3 - t2)
    return {"hash_4096_tokens": summary(th), "find_matches": summary(tm), "kv_cost_and_rank_64_endpoints": summary(ts)}


def bench_match_by_kind(ix: KvIndex, kinds: dict, n: int, rounds: int) -> dict:
    """kvyard's find_matches per prompt kind (hashes computed beforehand, `rounds` rounds of n as for the
    decisions), and hash + find_matches timed together: what Dynamo's binding is timed on."""
    out = {}
    for kind, prompts in kinds.items():
        views = [block_hashes_view(p.tolist(), BS) for p in prompts]
        per_round = []
        for _ in range(rounds):
            ts = []
            for k in range(n + 100):
                h = views[k % len(views)]
                t0 = time.perf_counter_ns()
                ix.find_matches(h)
                dt = time.perf_counter_ns() - t0
                if k >= 100:
                    ts.append(dt)
            per_round.append(ts)
        hm = []
        for k in range(n + 100):
            toks = prompts[k % len(prompts)].tolist()
            t0 = time.perf_counter_ns()
            ix.find_matches(block_hashes_view(toks, BS))
            dt = time.perf_counter_ns() - t0
            if k >= 100:
                hm.append(dt)
        out[kind] = {"find_matches": rounds_summary(per_round),
                     "hash_plus_find_matches": summary(hm)}
    return out


def expected_overlaps(ix: KvIndex, kinds: dict) -> dict:
    """{kind: [{worker index: blocks}]} from kvyard's index, checked against how the prompts were cached:
    full, 256 blocks on 8 workers; half, 128 on 4; miss, nothing."""
    want = {"miss": (0, 0), "half": (4, 128), "full": (8, 256)}
    out = {}
    for kind, prompts in kinds.items():
        out[kind] = []
        for i, p in enumerate(prompts):
            got = {worker_index(w): d for w, d in ix.find_matches(block_hashes_view(p.tolist(), BS)).items()}
            n, depth = want[kind]
            if len(got) != n or any(d != depth for d in got.values()):
                raise AssertionError(f"kvyard find_matches, {kind} prompt {i}: {got}, expected {n} workers at {depth}")
            out[kind].append(got)
    return out


def worker_index(worker_id: str) -> int:
    """kvyard's bench worker ids are "w<n>"; Dynamo's are ints."""
    return int(worker_id.lstrip("w"))


def write_job(job_dir: str | Path, events: list, setup: list, prompts: dict, expect: dict, *, queries: int, rounds: int,
              cpu: int) -> Path:
    """The job for dynamo_radix_micro.py: `events` [(worker_id, BlockStored)] (timed ingest) and `setup`
    [(worker_id, hashes, parent, tokens)] (the prompts' cached prefixes) as pack_event records, the prompts
    {kind: [token ids]} and the overlaps {kind: [{worker index: blocks}]} each must get."""
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    with open(job_dir / "events.bin", "wb") as f:
        for wid, ev in events:
            f.write(pack_event(worker_index(wid), ev.block_hashes, ev.parent_block_hash, ev.token_ids))
    with open(job_dir / "setup.bin", "wb") as f:
        for wid, hashes, parent, toks in setup:
            f.write(pack_event(worker_index(wid), hashes, parent, toks))
    job = {"block_size": BS, "events_file": "events.bin", "setup_file": "setup.bin", "queries": queries, "rounds": rounds,
           "cpu": cpu, "prompts": {k: [list(p) for p in ps] for k, ps in prompts.items()},
           "expect": {k: [{str(w): d for w, d in e.items()} for e in es] for k, es in expect.items()}}
    path = job_dir / "job.json"
    path.write_text(json.dumps(job))
    return path


def parse_last_json(stdout: str) -> dict:
    """The Dynamo script prints one JSON object; anything a library printed before it is skipped."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON object in the Dynamo script's output")


def run_dynamo(python: str | Path, job_path: Path, cpu: int, timeout_s: float = 3600) -> dict:
    """Run dynamo_radix_micro.py under Dynamo's interpreter, pinned to `cpu` (taskset where present; the
    script also pins itself before importing Dynamo)."""
    cmd = [str(python), str(DYNAMO_SCRIPT), str(job_path)]
    if cpu >= 0 and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(cpu)] + cmd
    env = dict(os.environ, DYN_LOG=os.environ.get("DYN_LOG", "error"))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {p.returncode}:\n{p.stderr[-4000:]}")
    out = parse_last_json(p.stdout)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["command"] = shlex.join(cmd)
    return out


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _pair(k: dict, d: dict) -> dict:
    return {"kvyard_p50_us": k["p50_us"], "dynamo_p50_us": d["p50_us"], "p50_ratio": _ratio(k["p50_us"], d["p50_us"]),
            "kvyard_p99_us": k["p99_us"], "dynamo_p99_us": d["p99_us"], "p99_ratio": _ratio(k["p99_us"], d["p99_us"])}


def side_by_side(result: dict) -> dict:
    """Ratios kvyard / Dynamo from a result holding both parts (all samples, not the quietest round)."""
    dyn, mbk = result["dynamo"], result["match_by_kind"]
    ing, ding = result["ingest"], dyn["ingest"]
    out = {
        "ratio_is": "kvyard / Dynamo: for times below 1 means kvyard is faster; for blocks/s above 1 means kvyard is faster",
        "hash_4096_tokens": _pair(result["parts_half_prompt"]["hash_4096_tokens"], dyn["hash_4096_tokens"]),
        "find_matches": {k: _pair(mbk[k]["find_matches"]["all"], dyn["find_matches"][k]["all"]) for k in mbk if k in dyn["find_matches"]},
        "hash_plus_find_matches": {k: _pair(mbk[k]["hash_plus_find_matches"], dyn["hash_plus_find_matches"][k])
                                   for k in mbk if k in dyn["hash_plus_find_matches"]},
        "ingest_store_blocks_per_s": {"kvyard": ing["store_blocks_per_s"], "dynamo": ding["store_blocks_per_s"],
                                      "ratio": _ratio(ing["store_blocks_per_s"], ding["store_blocks_per_s"])},
        "ingest_remove_blocks_per_s": {"kvyard": ing.get("remove_blocks_per_s_leaf_first"), "dynamo": ding.get("remove_blocks_per_s"),
                                       "ratio": _ratio(ing.get("remove_blocks_per_s_leaf_first"), ding.get("remove_blocks_per_s"))},
        "dynamo_call_floor_p50_us": {k: v["p50_us"] for k, v in dyn["call_floor"].items() if isinstance(v, dict)},
    }
    return out


def _us(x) -> str:
    return "–" if x is None else f"{x:,.1f}"


def _r(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def render_md(result: dict, command: str) -> str:
    """benchmarks/results/router_micro.md: kvyard vs Dynamo's RadixTree binding, targets, load, caveat."""
    t, dec, m = result["target"], result["decision"], result["machine"]
    lines = ["# Router micro-benchmark: kvyard vs Dynamo's RadixTree binding", "",
             f"Recorded {result['recorded_at']} with `{command}`.", "",
             f"Machine: {m['cores']} cores, pinned to core {m['pinned_core']}, Python {m['python']}; "
             f"1/5/15-min load average {' / '.join(str(x) for x in m['loadavg_before'])} before, "
             f"{' / '.join(str(x) for x in m['loadavg_after'])} after."]
    dyn = result.get("dynamo")
    if dyn and "loadavg_before" in dyn:
        lines[-1] += (f" Dynamo part: {' / '.join(str(x) for x in dyn['loadavg_before'])} before, "
                      f"{' / '.join(str(x) for x in dyn['loadavg_after'])} after.")
    loads = [m["loadavg_before"][0], m["loadavg_after"][0]] + ([dyn["loadavg_before"][0], dyn["loadavg_after"][0]] if dyn and "loadavg_before" in dyn else [])
    if max(loads) >= 1.0:
        lines += ["", f"**Load.** The 1-minute load average reached {max(loads)} during the run (other jobs share this "
                  f"{m['cores']}-core machine): tails (p99) are mostly scheduler noise, Dynamo's more so, since each of its "
                  "calls waits for its background thread to be scheduled on the same core."]
    ing = result["ingest"]
    lines += ["", f"## kvyard routing decision (hash + match + cost 64 endpoints + rank + book), {ing['blocks']:,} indexed blocks", "",
              "| prompt | p50 µs | p90 µs | p99 µs | quietest-round p50 µs | target p50 ≤ {} / p99 ≤ {} |".format(
                  t["decision_p50_us"], t["decision_p99_us"]),
              "|---|---|---|---|---|---|"]
    for k, d in dec.items():
        a = d["all"]
        ok = a["p50_us"] <= t["decision_p50_us"] and a["p99_us"] <= t["decision_p99_us"]
        lines.append(f"| {k} | {_us(a['p50_us'])} | {_us(a['p90_us'])} | {_us(a['p99_us'])} | "
                     f"{_us(d['quietest_round']['p50_us'])} | {'met' if ok else 'missed'} |")
    core = result.get("decision_core")
    if core:
        lines += ["", "The same prompts, timed over what the issue calls the decision, hash + match + cost (+ rank, in one C pass "
                  "with the cost), without the booking that follows it in Router.route (the worker's load and the prompt's "
                  "pending predictions). Timed after the decisions above, so matching probes the pending table they "
                  "filled (the prompts' tails are fresh: no pending hit), where the decisions began with none; the half "
                  "prompt's 128-block walk pays for that:", "",
                  "| prompt | p50 µs | p90 µs | p99 µs | quietest-round p50 µs | target p50 ≤ {} / p99 ≤ {} |".format(
                      t["decision_p50_us"], t["decision_p99_us"]), "|---|---|---|---|---|---|"]
        for k, d in core.items():
            a = d["all"]
            ok = a["p50_us"] <= t["decision_p50_us"] and a["p99_us"] <= t["decision_p99_us"]
            lines.append(f"| {k} | {_us(a['p50_us'])} | {_us(a['p90_us'])} | {_us(a['p99_us'])} | "
                         f"{_us(d['quietest_round']['p50_us'])} | {'met' if ok else 'missed'} |")
    parts = result.get("parts_half_prompt", {})
    if "kv_cost_and_rank_64_endpoints" in parts:
        lines += ["", "Parts, half prompt, p50 (p99) µs: hash 4,096 tokens {}; find_matches {}; cost + rank of 64 endpoints {}.".format(
            *(f"{_us(parts[k]['p50_us'])} ({_us(parts[k]['p99_us'])})" for k in ("hash_4096_tokens", "find_matches", "kv_cost_and_rank_64_endpoints")))]
    pend = result.get("pending_predictions")
    if pend:
        lines += ["", f"Decisions with pending predictions on (TTL {pend['ttl_s']:g} s, router/kv_index.py): each routed miss or half "
                  "prompt records its new blocks as pending on its worker, so those prompts carry fresh tokens per request; "
                  f"{pend['blocks_after_decisions']:,} blocks were pending after the decisions (matching probes that table too)."]
    ok = ing["store_blocks_per_s"] >= t["ingest_blocks_per_s"]
    lines += ["", f"kvyard ingest: {ing['store_blocks_per_s']:,} blocks/s ({ing['blocks_per_event']} blocks per event, "
              f"{ing['blocks']:,} blocks; target ≥ {t['ingest_blocks_per_s']:,}: {'met' if ok else 'missed'})."]
    sbs = result.get("side_by_side")
    if not sbs:
        lines += ["", f"Dynamo not measured: {result.get('dynamo_skipped', 'no result')}.", ""]
        return "\n".join(lines)
    lines += ["", f"## Side by side (Dynamo ai-dynamo-runtime {dyn.get('version', '?')}, same events and prompts, same core)", "",
              "Ratio = kvyard / Dynamo: for times below 1 means kvyard is faster, for blocks/s above 1. "
              "Hash: kvyard's chained block hashes (what Router.route uses) vs `compute_block_hash_for_seq`, each given a "
              "fresh list of 4,096 ints. find_matches: kvyard's index given its uint64 view vs `RadixTree.find_matches` given "
              "the list of 256 Dynamo hashes. All samples of all rounds. Dynamo's binding has no counterpart of kvyard's "
              "whole decision (cost + rank + book: its KvRouter needs a running DistributedRuntime).", "",
              "| operation | kvyard p50 µs | Dynamo p50 µs | ratio p50 | kvyard p99 µs | Dynamo p99 µs | ratio p99 |",
              "|---|---|---|---|---|---|---|"]

    def row(name, p):
        lines.append(f"| {name} | {_us(p['kvyard_p50_us'])} | {_us(p['dynamo_p50_us'])} | {_r(p['p50_ratio'])} | "
                     f"{_us(p['kvyard_p99_us'])} | {_us(p['dynamo_p99_us'])} | {_r(p['p99_ratio'])} |")
    row("hash 4,096 tokens (256 blocks)", sbs["hash_4096_tokens"])
    for k, p in sbs["find_matches"].items():
        row(f"find_matches, {k} prompt", p)
    for k, p in sbs["hash_plus_find_matches"].items():
        row(f"hash + find_matches, {k} prompt", p)
    lines += ["", "| ingest | kvyard blocks/s | Dynamo blocks/s | ratio |", "|---|---|---|---|"]
    for name, key in (("store, 16 blocks per event", "ingest_store_blocks_per_s"), ("remove, 16 blocks per event, leaf events first", "ingest_remove_blocks_per_s")):
        p = sbs[key]
        lines.append(f"| {name} | {'–' if p['kvyard'] is None else format(p['kvyard'], ',')} | "
                     f"{'–' if p['dynamo'] is None else format(p['dynamo'], ',')} | {_r(p['ratio'])} |")
    di = dyn["ingest"]
    cf = sbs["dynamo_call_floor_p50_us"]
    lines += ["", f"Dynamo ingest: {di['events']:,} stored events, {di['blocks']:,} blocks ({di['store_events_per_s']:,} events/s), "
              f"as JSON bytes of its KvCacheEvent with tokens_hash precomputed (a worker's publisher does that; it cost "
              f"{di['tokens_hash_and_json_us_per_event']} µs per event here, not counted). kvyard's figure includes hashing "
              "each event's token ids into its own chained block hashes.", "",
              "Dynamo binding call floor (p50): " + ", ".join(f"{k} {_us(v)} µs" for k, v in cf.items()) + ".", "",
              "**Caveat.** Dynamo's Python `RadixTree` hands every call to a dedicated Rust background thread and waits "
              "for the answer, so each `find_matches`/`apply_event` above includes that hand-off (see the call floor: "
              "`find_matches([])` does no tree work) and the Python-list/JSON conversion. These are the binding's "
              "numbers, not the speed of Dynamo's in-process indexer inside its Rust router (its docs put that at "
              "p99 < 10 µs). Both sides run on the same pinned core; the binding's thread shares it with the caller.",
              f"Every Dynamo overlap was checked against kvyard's ({', '.join(f'{k} {v}' for k, v in dyn.get('overlaps_checked', {}).items())} "
              "prompts: full 256 blocks on 8 workers, half 128 on 4, miss none).", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queries", type=int, default=2000, help="decisions per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--cpu", type=int, default=0, help="pin to this core (-1: do not pin)")
    ap.add_argument("--out", default=str(RESULTS / "router_micro.json"), help="JSON result; the .md goes beside it")
    ap.add_argument("--dynamo-python", default=str(DYNAMO_PYTHON),
                    help="Dynamo's interpreter for dynamo_radix_micro.py (default: <repo>/.venv-dynamo/bin/python)")
    ap.add_argument("--no-dynamo", action="store_true", help="skip the Dynamo side")
    ap.add_argument("--no-drain", action="store_true", help="the router without prefill drain (router/load.py)")
    ap.add_argument("--dynamo-timeout", type=float, default=3600)
    args = ap.parse_args()
    command = shlex.join(["python", "benchmarks/router_micro.py"] + sys.argv[1:])
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
    # the same removals leaf events first (the order Dynamo's side uses: its tree drops a removed block's
    # descendants), then back again
    t0 = time.perf_counter()
    for wid, ev in reversed(removals):
        ix.apply(wid, ev)
    ingest["remove_blocks_per_s_leaf_first"] = round(16 * len(removals) / (time.perf_counter() - t0))
    for wid, ev in events[: len(events) // 4]:
        ix.apply(wid, ev)
    ingest.update(bench_ingest_wire(events, 8000))
    ingest.update(bench_event_sizes(rng))

    # the frontend's load bookkeeping: prefill drain on (router/load.py), each worker with a measured rate
    router = Router(build_policy("kv", index=ix, seed=7), LoadTracker(drain=not args.no_drain))
    endpoints = [Endpoint(worker_id=f"w{w}", url=f"http://127.0.0.1:{8100 + w}", model="m", block_size=BS) for w in range(WORKERS)]
    t_warm = time.monotonic()
    for ep in endpoints:
        router.loads.on_routed(f"warm-{ep.worker_id}", ep.worker_id, 4096, BS, now=t_warm - 1.0)
        router.loads.on_first_token(f"warm-{ep.worker_id}", now=t_warm - 0.9)
        router.loads.on_complete(f"warm-{ep.worker_id}")
    for w, ep in enumerate(endpoints):  # background load: 0-5 running requests, some still in prefill
        for j in range(w % 6):
            router.loads.on_routed(f"bg{w}-{j}", ep.worker_id, rng.randrange(512, 4096), BS)
            if j % 2:
                router.loads.on_first_token(f"bg{w}-{j}")

    setup: list = []  # the prompts' cached prefixes, stored directly (Dynamo gets them as stored events)

    def store(wid, hashes, toks):
        ix.store(wid, hashes, None, toks, BS)
        setup.append((wid, hashes, None, toks))

    def prompts(kind: str) -> list[list[int]]:
        out = []
        for i in range(64):
            tail = [rng.randrange(50_000, 60_000) for _ in range(PROMPT)]
            if kind == "miss":
                out.append(tail)
            elif kind == "half":  # a 1,024-token cached sequence + its own next 1,024 tokens cached on 4 workers
                head = seqs[i] + seqs[i + 64]
                for w in range(4):
                    store(f"w{(i + w * 16) % WORKERS}", [10**9 + i * 1000 + w * 100 + b for b in range(128)], head)
                out.append(head + tail[: PROMPT - 2048])
            else:
                full = tail
                for w in range(8):
                    store(f"w{(i + w * 8) % WORKERS}", [2 * 10**9 + i * 1000 + w * 300 + b for b in range(256)], full)
                out.append(full)
        return out

    gc.collect()
    gc.freeze()
    kinds = {k: [array("I", p) for p in prompts(k)] for k in KINDS}
    expect = expected_overlaps(ix, kinds)
    pool = array("I", (rng.randrange(60_000, 70_000) for _ in range(2 * args.queries * args.rounds + 2 * PROMPT)))
    fresh = {"miss": 0, "half": 2048, "full": None}
    decision = {k: bench_route(router, endpoints, p, args.queries, args.rounds, fresh[k], pool) for k, p in kinds.items()}
    core = {k: bench_core(router, endpoints, p, args.queries, args.rounds, fresh[k], pool) for k, p in kinds.items()}
    pending = {"blocks_after_decisions": ix.pending_blocks(), "ttl_s": ix.pending_ttl_s}
    parts = bench_parts(router, endpoints, kinds["half"], args.queries)
    match_by_kind = bench_match_by_kind(ix, kinds, args.queries, args.rounds)
    result = {
        "what": "Router('kv').route(): 4,096-token prompt, block size 16, 64 endpoints, ~1M indexed blocks; one core",
        "target": dict(TARGET),
        "decision": decision,
        "decision_core": core,
        "pending_predictions": pending,
        "parts_half_prompt": parts,
        "match_by_kind": match_by_kind,
        "ingest": ingest,
        "implementation": {"hashing": hashing.IMPLEMENTATION, "kernels": _kernels.IMPLEMENTATION},
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "pinned_core": args.cpu, "loadavg_before": [round(x, 2) for x in load_before]},
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    dyn_python = Path(args.dynamo_python)
    if args.no_dynamo:
        result["dynamo_skipped"] = "--no-dynamo"
    elif not dyn_python.exists():
        result["dynamo_skipped"] = f"{dyn_python} not found (scripts/install_dynamo.sh installs it)"
        print(f"note: Dynamo side skipped: {result['dynamo_skipped']}", file=sys.stderr)
    else:
        with tempfile.TemporaryDirectory(prefix="router_micro_dynamo_") as tmp:
            job = write_job(tmp, events, setup, {k: [p.tolist() for p in ps] for k, ps in kinds.items()}, expect,
                            queries=args.queries, rounds=args.rounds, cpu=args.cpu)
            result["dynamo"] = run_dynamo(dyn_python, job, args.cpu, args.dynamo_timeout)
        result["side_by_side"] = side_by_side(result)
    result["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]  # after the Dynamo side too
    result["command"] = command
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(render_md(result, command))
    print(json.dumps({k: result[k] for k in ("decision", "decision_core", "parts_half_prompt", "ingest", "machine", "side_by_side") if k in result}, indent=1))


if __name__ == "__main__":
    main()
