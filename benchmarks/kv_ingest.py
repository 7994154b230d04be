"""KV-event ingestion: the CPU a frontend spends per event batch it reads from an engine, two trees side by side.

    PYTHONPATH=. .venv/bin/python benchmarks/kv_ingest.py --baseline /tmp/base [--rounds 3]

One ZeroMQ PUB socket in this process publishes KV event batches in vLLM's wire format ([topic, seq, payload],
workers/vllm/kv_events.py), or SGLang's with --format sglang. Two child processes subscribe to it at once, each a KvEventIngestor (router/events.py)
feeding a KvIndex, as a frontend runs them: `new` on this tree and `base` on the tree at --baseline. Both read the
same batches at the same moments, so the machine's noise falls on both; each child's CPU (utime + stime, all
threads, /proc) is read around the publishing, and each child reports how many batches it applied (a run where
either missed one is void). Workloads (paced, every batch one BlockStored; a BlockRemoved of old blocks every 16
batches keeps the index bounded):
  short  4 blocks a batch (a 64-token prompt with its first outputs), 2,000 batches a second: one engine's
         events under short requests, where each batch wakes the frontend on its own
  long   64 blocks a batch (a 1,024-token prefill chunk of a long prompt), 500 batches a second
  evict  the same chunk on a full cache: each batch also evicts 64 older blocks, one BlockRemoved event each (as
         vLLM publishes evictions), 250 batches a second
Reported: CPU-us per batch and per stored block for each tree, and new / base per round. Writes
benchmarks/results/<--out>.{json,md} (default kv_ingest).
"""

from __future__ import annotations

import argparse
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

from benchmarks.frontend_overhead import cpu_seconds  # noqa: E402  (utime + stime of a process, from /proc)

RESULTS = ROOT / "benchmarks" / "results"
WORKLOADS = {"short": (4, 2000.0), "long": (64, 500.0), "evict": (64, 250.0)}  # blocks a batch, batches a second
BLOCK = 16
CHILD = r"""
import asyncio, json, signal, sys
from router.events import KvEventIngestor
from router.kv_index import KvIndex
from workers.types import WorkerInfo

async def main(endpoint):
    index = KvIndex()
    ing = KvEventIngestor(index)
    ing.sync([WorkerInfo(worker_id="w0", model="m", backend=sys.argv[2], url="http://127.0.0.1:9", block_size=16,
                         kv_events_endpoint=endpoint, kv_events_topic="kv-events")])
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    stats = ing.stats()["w0"]
    await ing.close()
    print(json.dumps(stats, default=str), flush=True)

try:
    import uvloop  # the frontend's loop (orchestrator/cli.py)
    uvloop.run(main(sys.argv[1]))
except ImportError:
    asyncio.run(main(sys.argv[1]))
"""


def child(tree: Path, endpoint: str, fmt: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    p = subprocess.Popen([sys.executable, "-c", CHILD, endpoint, fmt], cwd=str(tree), env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready", f"the ingestor of {tree} did not start"
    return p


def batches(workload: str, n: int, rng: random.Random, fmt: str = "vllm"):
    """n payloads: each stores `blocks` new blocks. `evict`: each also evicts the batch stored 16 before, one
    BlockRemoved a block; otherwise every 16th removes the 16 batches stored before those in one event."""
    import importlib

    from router.kv_events import BlockRemoved, BlockStored

    encode_batch = importlib.import_module(f"workers.{fmt}.kv_events").encode_batch

    blocks = WORKLOADS[workload][0]
    out, stored = [], []
    for i in range(n):
        hashes = [rng.getrandbits(63) for _ in range(blocks)]
        events = [BlockStored(block_hashes=hashes, parent_block_hash=None,
                              token_ids=[rng.randrange(50000) for _ in range(blocks * BLOCK)], block_size=BLOCK)]
        stored.append(hashes)
        if workload == "evict":
            if len(stored) > 16:
                events[:0] = [BlockRemoved(block_hashes=[h]) for h in stored[-17]]  # evicted to make room
        elif i % 16 == 15 and len(stored) > 16:
            events.append(BlockRemoved(block_hashes=[h for old in stored[-32:-16] for h in old]))
        out.append(encode_batch(time.time(), events))
    return out


def run_round(trees: dict[str, Path], workload: str, n: int, rng: random.Random, fmt: str = "vllm") -> dict:
    import zmq

    blocks, rate = WORKLOADS[workload]
    payloads = batches(workload, n, rng, fmt)
    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/kv.sock"
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.bind(endpoint)
        kids = {name: child(tree, endpoint, fmt) for name, tree in trees.items()}
        time.sleep(1.0)  # the subscriptions reach the publisher (ZeroMQ's slow joiner)
        before = {name: cpu_seconds(p.pid) for name, p in kids.items()}
        t0 = time.perf_counter()
        for seq, payload in enumerate(payloads):
            due = t0 + seq / rate
            while (wait := due - time.perf_counter()) > 0:
                time.sleep(wait)
            pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])
        time.sleep(1.0)  # the last batches are read
        after = {name: cpu_seconds(p.pid) for name, p in kids.items()}
        row = {"workload": workload, "batches": n, "blocks_per_batch": blocks, "rate": rate}
        for name, p in kids.items():
            p.send_signal(signal.SIGTERM)
            out, _ = p.communicate(timeout=20)
            stats = json.loads(out.strip().splitlines()[-1])
            applied = stats.get("batches")
            row[name] = {"cpu_s": round(after[name] - before[name], 4), "batches_applied": applied,
                         "us_per_batch": round((after[name] - before[name]) / n * 1e6, 2),
                         "us_per_block": round((after[name] - before[name]) / (n * blocks) * 1e6, 3)}
            if applied != n:
                row[name]["void"] = f"applied {applied} of {n} batches"
        pub.close()
        ctx.term()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout of the tree to compare against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=10.0, help="publishing time per workload and round")
    ap.add_argument("--workloads", default="short,long,evict")
    ap.add_argument("--format", choices=["vllm", "sglang"], default="vllm",
                    help="the engine's wire format (workers/<format>/kv_events.py), as the ingestor reads it")
    ap.add_argument("--out", default="kv_ingest")
    args = ap.parse_args()
    from benchmarks.common import result_header

    trees = {"base": args.baseline.resolve(), "new": ROOT}
    rng = random.Random(7)
    rows = []
    for r in range(args.rounds):
        for wl in args.workloads.split(","):
            blocks, rate = WORKLOADS[wl]
            order = dict(reversed(list(trees.items()))) if r % 2 else trees  # which child starts first, alternated
            row = run_round(order, wl, int(rate * args.seconds), rng, args.format)
            row["round"] = r
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for wl in args.workloads.split(","):
        rs = [x for x in rows if x["workload"] == wl and "void" not in x["base"] and "void" not in x["new"]]
        if not rs:
            continue
        summary[wl] = {
            "base_us_per_batch": statistics.median(x["base"]["us_per_batch"] for x in rs),
            "new_us_per_batch": statistics.median(x["new"]["us_per_batch"] for x in rs),
            "ratios": [round(x["new"]["cpu_s"] / x["base"]["cpu_s"], 3) for x in rs if x["base"]["cpu_s"]],
        }
    cmd = f"benchmarks/kv_ingest.py --baseline {args.baseline} --rounds {args.rounds} --seconds {args.seconds:g}" + (
        f" --workloads {args.workloads}" if args.workloads != "short,long,evict" else "") + (
        f" --format {args.format}" if args.format != "vllm" else "")
    result = {**result_header("kv_ingest"), "command": cmd, "rows": rows, "summary": summary}
    result["loadavg"]["end"] = round(os.getloadavg()[0], 2)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=1))
    lines = [f"`{cmd}`: one publisher, two ingestors on the same batches at once (base = {args.baseline}, new = this tree). "
             f"CPU of each ingestor process from /proc; machine: {result['machine']}, load {result['loadavg']}.", "",
             "| workload | blocks / batch | batches / s | base: CPU-us / batch | new: CPU-us / batch | new / base per round |",
             "|---|---|---|---|---|---|"]
    for wl, s in summary.items():
        blocks, rate = WORKLOADS[wl]
        lines.append(f"| {wl} | {blocks} | {rate:g} | {s['base_us_per_batch']:.1f} | {s['new_us_per_batch']:.1f} | "
                     f"{', '.join(f'{x:.2f}' for x in s['ratios'])} |")
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
