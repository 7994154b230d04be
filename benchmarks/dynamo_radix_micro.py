"""NVIDIA Dynamo's Python RadixTree on the same events and queries as benchmarks/router_micro.py.

Run by router_micro.py with Dynamo's interpreter (stdlib + `dynamo._core` only, no kvyard import):

    .venv-dynamo/bin/python benchmarks/dynamo_radix_micro.py JOB_DIR/job.json

The job (written by router_micro.write_job) holds kvyard's ingest events and query-setup stores in a
binary file (see EVENT_HEADER) and the prompts per kind, with the overlaps each prompt must get. This
script times, on one core (`cpu` in the job; set before the import so Dynamo's threads inherit it):

    hash          compute_block_hash_for_seq(prompt, 16) on the 4,096-token `half` prompts (per call)
    ingest        RadixTree.apply_event of the stored events (JSON bytes of Dynamo's KvCacheEvent, with
                  tokens_hash = Dynamo's own local hash of each block's tokens, computed before the clock
                  starts, as a worker's publisher would), then BlockRemoved of a quarter (last event first:
                  Dynamo drops a removed block's descendants) and their re-store
    find_matches  per prompt kind (miss / half / full), on hashes computed beforehand
    call floor    find_matches([]) / a 1-block miss (the binding's hand-off to its background thread with no
                  tree work) and compute_block_hash_for_seq([]) (a bare pyo3 call with no hand-off)

and checks every query's overlaps against the job's (full: 256 blocks on 8 workers, half: 128 on 4,
miss: none); it exits non-zero on any mismatch. Prints one JSON object on stdout.

Binding (ai-dynamo-runtime 1.6.1, from dynamo/_core.pyi and introspection):
    RadixTree()                                    every call is handed to a dedicated Rust thread
    RadixTree.apply_event(worker_id: int, kv_cache_event_bytes: bytes) -> None   (RuntimeError if refused)
    RadixTree.find_matches(sequence: list[int], early_exit=False) -> OverlapScores  (.scores: {(worker, dp_rank): blocks})
    compute_block_hash_for_seq(tokens, kv_block_size, block_mm_infos=None, lora_name=None, ...) -> list[int]
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import struct
import sys
import time
from array import array
from pathlib import Path

# One event record: worker (int32), number of blocks n (int32), parent block hash (int64; -1: none),
# then n int64 engine block hashes and n * block_size uint32 token ids, little-endian.
EVENT_HEADER = struct.Struct("<iiq")
NO_PARENT = -1


def pack_event(worker: int, block_hashes, parent: int | None, token_ids) -> bytes:
    h = array("q", block_hashes)
    t = array("I", token_ids)
    if sys.byteorder != "little":
        h.byteswap()
        t.byteswap()
    return EVENT_HEADER.pack(worker, len(h), NO_PARENT if parent is None else parent) + h.tobytes() + t.tobytes()


def read_events(path: str | Path, block_size: int) -> list[tuple[int, list[int], int | None, array]]:
    """[(worker, engine block hashes, parent or None, token ids as array('I'))] from pack_event records."""
    data = Path(path).read_bytes()
    out, off = [], 0
    while off < len(data):
        worker, n, parent = EVENT_HEADER.unpack_from(data, off)
        off += EVENT_HEADER.size
        h = array("q")
        h.frombytes(data[off:off + 8 * n])
        off += 8 * n
        t = array("I")
        t.frombytes(data[off:off + 4 * n * block_size])
        off += 4 * n * block_size
        if sys.byteorder != "little":
            h.byteswap()
            t.byteswap()
        out.append((worker, h.tolist(), None if parent == NO_PARENT else parent, t))
    return out


def stored_event_json(event_id: int, parent: int | None, block_hashes: list[int], local_hashes: list[int]) -> bytes:
    """JSON bytes of Dynamo's KvCacheEvent for a BlockStored: what RadixTree.apply_event parses."""
    return json.dumps({"event_id": event_id, "data": {"stored": {
        "parent_hash": parent,
        "blocks": [{"block_hash": b, "tokens_hash": t} for b, t in zip(block_hashes, local_hashes)]}}},
        separators=(",", ":")).encode()


def removed_event_json(event_id: int, block_hashes: list[int]) -> bytes:
    return json.dumps({"event_id": event_id, "data": {"removed": {"block_hashes": list(block_hashes)}}},
                      separators=(",", ":")).encode()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(ns: list[int]) -> dict:
    us = [x / 1000 for x in ns]
    return {"p50_us": round(pct(us, 0.5), 2), "p90_us": round(pct(us, 0.9), 2), "p99_us": round(pct(us, 0.99), 2),
            "mean_us": round(statistics.fmean(us), 2), "n": len(us)}


def scores_by_worker(overlap) -> dict[int, int]:
    """OverlapScores.scores keys are (worker_id, dp_rank) in 1.6.1 (plain worker ids in older releases)."""
    out: dict[int, int] = {}
    for k, v in overlap.scores.items():
        w = k[0] if isinstance(k, tuple) else k
        out[w] = max(out.get(w, 0), v)
    return out


def check_overlaps(kind: str, got: list[dict[int, int]], expect: list[dict]) -> None:
    for i, (g, e) in enumerate(zip(got, expect)):
        e = {int(w): d for w, d in e.items()}
        if g != e:
            raise AssertionError(f"Dynamo find_matches, {kind} prompt {i}: got {g}, expected {e}")
    if len(got) != len(expect):
        raise AssertionError(f"{kind}: {len(got)} results for {len(expect)} prompts")


def main(argv: list[str]) -> None:
    job = json.loads(Path(argv[1]).read_text())
    base = Path(argv[1]).parent
    if job.get("cpu", -1) >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {job["cpu"]})  # before the import: Dynamo's threads inherit it
    os.environ.setdefault("DYN_LOG", "error")
    from importlib.metadata import version

    from dynamo._core import RadixTree, compute_block_hash_for_seq

    bs, n, rounds = job["block_size"], job["queries"], job["rounds"]
    hash_fn = compute_block_hash_for_seq
    out: dict = {"version": version("ai-dynamo-runtime"), "pinned_core": job.get("cpu", -1),
                 "loadavg_before": [round(x, 2) for x in os.getloadavg()]}

    # events -> Dynamo's JSON bytes, tokens_hash from Dynamo's own local block hash (untimed: a worker's
    # publisher computes it before the event reaches the router's indexer)
    t0 = time.perf_counter()
    events = read_events(base / job["events_file"], bs)
    setup = read_events(base / job["setup_file"], bs)
    t1 = time.perf_counter()
    eid = 0
    stored = []
    for worker, hashes, parent, toks in events:
        stored.append((worker, stored_event_json(eid, parent, hashes, hash_fn(toks.tolist(), bs))))
        eid += 1
    prep_s = time.perf_counter() - t1
    quarter = len(events) // 4
    removed = []  # leaf events first: Dynamo drops a removed block's descendants, so a later remove of a child fails
    for worker, hashes, _, _ in reversed(events[:quarter]):
        removed.append((worker, removed_event_json(eid, hashes)))
        eid += 1
    restored = stored[:quarter]
    setup_bytes = []
    for worker, hashes, parent, toks in setup:
        setup_bytes.append((worker, stored_event_json(eid, parent, hashes, hash_fn(toks.tolist(), bs))))
        eid += 1
    blocks = sum(len(h) for _, h, _, _ in events)
    del events
    out["job_read_s"] = round(t1 - t0, 2)

    tree = RadixTree()
    apply = tree.apply_event
    gc.collect()
    t0 = time.perf_counter()
    for worker, ev in stored:
        apply(worker, ev)
    store_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for worker, ev in removed:
        apply(worker, ev)
    remove_s = time.perf_counter() - t0
    for worker, ev in restored:  # back to ~1M blocks, as kvyard's index
        apply(worker, ev)
    for worker, ev in setup_bytes:
        apply(worker, ev)
    per_event = blocks / len(stored)
    out["ingest"] = {
        "events": len(stored), "blocks": blocks, "blocks_per_event": round(per_event, 2),
        "store_events_per_s": round(len(stored) / store_s), "store_blocks_per_s": round(blocks / store_s),
        "remove_blocks_per_s": round(per_event * len(removed) / remove_s) if removed else None,
        "remove_order": "the first quarter of the stored events, last first (leaves before their parents)",
        "tokens_hash_and_json_us_per_event": round(prep_s / len(stored) * 1e6, 2),
        "setup_events": len(setup_bytes),
        "format": "JSON bytes of KvCacheEvent {event_id, data: {stored: {parent_hash, blocks: [{block_hash, tokens_hash}]}}}",
    }
    del stored, removed, restored, setup_bytes
    gc.collect()

    prompts = {k: [array("I", p) for p in ps] for k, ps in job["prompts"].items()}
    hashes = {k: [hash_fn(p.tolist(), bs) for p in ps] for k, ps in prompts.items()}
    for k in prompts:  # correctness first: every prompt's overlaps as kvyard's index reports them
        check_overlaps(k, [scores_by_worker(tree.find_matches(h)) for h in hashes[k]], job["expect"][k])
    out["overlaps_checked"] = {k: len(v) for k, v in hashes.items()}

    def timed(fn, args_list, n_calls: int) -> list[int]:
        ts = []
        for k in range(n_calls + 100):
            a = args_list[k % len(args_list)]
            t0 = time.perf_counter_ns()
            fn(*a)
            dt = time.perf_counter_ns() - t0
            if k >= 100:
                ts.append(dt)
        return ts

    def rounds_of(fn, args_list) -> dict:
        per_round = [timed(fn, args_list, n) for _ in range(rounds)]
        quietest = min(per_round, key=lambda ts: pct(ts, 0.5))
        return {"all": summary([t for ts in per_round for t in ts]), "quietest_round": summary(quietest),
                "round_p50s_us": [round(pct(ts, 0.5) / 1000, 1) for ts in per_round]}

    gc.collect()
    gc.freeze()
    half = prompts["half"]
    # a fresh list of ints per call, as kvyard's hash gets (the copy is not timed)
    th = []
    for k in range(n + 100):
        toks = half[k % len(half)].tolist()
        t0 = time.perf_counter_ns()
        hash_fn(toks, bs)
        dt = time.perf_counter_ns() - t0
        if k >= 100:
            th.append(dt)
    out["hash_4096_tokens"] = summary(th)
    fm = tree.find_matches
    out["find_matches"] = {k: rounds_of(fm, [(h,) for h in hs]) for k, hs in hashes.items()}
    # hash + match of one prompt, timed together (the part of a decision the binding covers)
    hm = {}
    for kind, ps in prompts.items():
        ts = []
        for k in range(n + 100):
            toks = ps[k % len(ps)].tolist()
            t0 = time.perf_counter_ns()
            fm(hash_fn(toks, bs))
            dt = time.perf_counter_ns() - t0
            if k >= 100:
                ts.append(dt)
        hm[kind] = summary(ts)
    out["hash_plus_find_matches"] = hm
    out["call_floor"] = {
        "find_matches_empty": summary(timed(fm, [([],)], n)),
        "find_matches_1_block_miss": summary(timed(fm, [([12345],)], n)),
        "hash_empty": summary(timed(hash_fn, [([], bs)], n)),
        "what": "find_matches([]) and a 1-block miss: the hand-off to the tree's thread and back with no tree work; "
                "compute_block_hash_for_seq([]): a bare pyo3 call, no hand-off",
    }
    out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv)
