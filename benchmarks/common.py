"""Small pieces the feature benchmarks share: the `kvyard up` cluster flags and the header of a result file."""

from __future__ import annotations

import argparse
import os
import sys
import time

__all__ = ["add_cluster_args", "result_header"]


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
