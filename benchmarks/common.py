"""Small pieces the feature benchmarks share: the `kvyard up` cluster flags, the header of a result file, and
stopping a process group the benchmark started."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

__all__ = ["add_cluster_args", "reap_group", "result_header"]


def add_cluster_args(ap: argparse.ArgumentParser, *, workers: int, speedup: float, max_model_len: int, num_gpu_blocks: int,
                     port: int) -> None:
    """The flags routing.Cluster reads: workers, sim speed-up, block size, context, KV blocks per worker, ports
    (the frontend on `port`, engines from port + 10)."""
    ap.add_argument("--workers", type=int, default=workers)
    ap.add_argument("--speedup", type=float, default=speedup, help="sim speed-up (1: the profile's own step times)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=max_model_len)
    ap.add_argument("--num-gpu-blocks", type=int, default=num_gpu_blocks, help="KV blocks per worker")
    ap.add_argument("--port", type=int, default=port)
    ap.add_argument("--base-port", type=int, default=port + 10)


def result_header(name: str) -> dict:
    """What every result file starts with: the benchmark, when, the machine, the load average at the start."""
    return {"benchmark": name, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}", "loadavg": {"start": round(os.getloadavg()[0], 2)}}


async def reap_group(p: subprocess.Popen, wait_s: float = 10.0) -> None:
    """After a stop signal: wait up to `wait_s` for `p` (started with start_new_session) to exit, then SIGKILL its
    process group (stray children, engines it spawned) and collect it."""
    for _ in range(int(wait_s * 10)):
        if p.poll() is not None:
            break
        await asyncio.sleep(0.1)
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(10)
