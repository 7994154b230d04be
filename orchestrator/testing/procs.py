"""Processes for the reliability runs: a private Redis, `kvyard worker` and `kvyard frontend` children.

Used by tests/integration/test_redis_outage.py, benchmarks/faults.py and benchmarks/soak.py. Each child
runs in its own session (so a SIGKILL of its group takes its engine with it) and logs to a file.
The Redis is private (`redis-server --port N --save ''`, no persistence) so it can be killed and
restarted without touching the shared 127.0.0.1:6379; a restart comes back *empty*, like a
production Redis without persistence.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import httpx
from tokenizers import Tokenizer

from orchestrator.config.cluster import WorkerConfig
from orchestrator.testing.fake_engine import free_port, free_port_pair
from workers.sim.backend import SIM_TOKENIZER_DIR

__all__ = ["free_port", "RedisServer", "Child", "KvyardCluster", "rss_and_fds", "cpu_seconds", "descendants", "full_blocks"]




def rss_and_fds(pid: int) -> tuple[float, int] | None:
    """Resident memory (MiB) and open file descriptors of a live process, from /proc; None if gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss_pages = int(f.read().split()[1])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20, fds


def descendants(pid: int) -> list[int]:
    """Every live descendant of a process, children first (from /proc/<pid>/task/*/children)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a live process so far, from /proc; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


class RedisServer:
    """A private, non-persistent redis-server on its own port."""

    def __init__(self, port: int | None = None, log_dir: Path | None = None) -> None:
        self.port = port or free_port()
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not on PATH")
        log = open(self.log_dir / f"redis-{self.port}.log", "ab") if self.log_dir else subprocess.DEVNULL
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited with {self.proc.returncode}")
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no save; clients see their connections reset."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()
        self.restarts += 1

    def stop(self) -> None:
        self.kill()


class Child:
    """One `python -m orchestrator ...` process in its own session, logging to a file."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name, self.args, self.log_path = name, args, log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "--log-level", "info", *self.args],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the process and every descendant (a worker's engine runs in its own session, so the group
        alone would miss it, and the engine's parent-death SIGTERM would let it finish its streams politely):
        a crash, with no drain, no deregistration and the engine's connections reset mid-stream."""
        if self.proc is None:
            return
        for pid in [*descendants(self.proc.pid), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""


class KvyardCluster:
    """Sim workers and frontends as separate processes over one (private) Redis."""

    def __init__(self, redis_url: str, log_dir: Path, model: str = "simmodel", prefix: str = "kvyard-rel",
                 lease_ttl_s: float = 3.0, drain_timeout_s: float = 10.0, max_model_len: int = 8192) -> None:
        self.redis_url, self.log_dir, self.model, self.prefix = redis_url, log_dir, model, prefix
        self.lease_ttl_s, self.drain_timeout_s, self.max_model_len = lease_ttl_s, drain_timeout_s, max_model_len
        self.workers: dict[str, Child] = {}
        self.frontends: dict[str, Child] = {}
        self.frontend_ports: dict[str, int] = {}
        self._worker_args: dict[str, tuple] = {}
        self.engine_ports: dict[str, int] = {}  # worker name -> its engine's HTTP port (for direct probes)
        self.respawns = 0

    def add_worker(self, name: str, speedup: float = 10.0, engine_args: list[str] | None = None, backend: str = "sim",
                   worker_args: list[str] | None = None) -> Child:
        """`worker_args`: more `kvyard worker` flags (e.g. --role, --engine-cmd); `engine_args`: after `--`. The sim's
        --speedup goes after `--` for backend sim; for another backend, the caller puts it in --engine-cmd."""
        port = free_port()
        tail = ["--speedup", str(speedup)] if backend == "sim" else []
        c = Child(name, ["worker", "--backend", backend, "--model", "h200-llama3.1-8b", "--served-model-name", self.model,
                         "--port", str(port), "--kv-events-port", str(free_port_pair()), "--redis-url", self.redis_url,
                         "--discovery-prefix", self.prefix, "--lease-ttl", str(self.lease_ttl_s),
                         "--drain-timeout", str(self.drain_timeout_s), "--max-model-len", str(self.max_model_len),
                         *(worker_args or []), "--", *tail, *(engine_args or [])], self.log_dir)
        self.workers[name] = c
        self.engine_ports[name] = port
        self._worker_args[name] = (speedup, engine_args, backend, worker_args)
        c.start()
        return c

    def add_frontend(self, name: str, policy: str = "kv", port: int | None = None, extra: list[str] | None = None) -> Child:
        port = port or free_port()
        self.frontend_ports[name] = port
        c = Child(name, ["frontend", "--port", str(port), "--grpc-port", "0", "--redis-url", self.redis_url,
                         "--discovery-prefix", self.prefix, "--policy", policy, *(extra or [])], self.log_dir)
        self.frontends[name] = c
        c.start()
        return c

    def url(self, frontend: str) -> str:
        return f"http://127.0.0.1:{self.frontend_ports[frontend]}"

    async def cluster_view(self, frontend: str, client: httpx.AsyncClient) -> dict | None:
        try:
            r = await client.get(self.url(frontend) + "/api/cluster", timeout=2.0)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def logs(self, n: int = 1500) -> str:
        return "\n".join(f"--- {ch.name}\n{ch.log_tail(n)}" for ch in [*self.workers.values(), *self.frontends.values()])

    async def wait_ready(self, frontend: str, n_workers: int, timeout: float = 90.0, exact: bool = False,
                         respawn: bool = True) -> dict:
        """The frontend's view once it sees n_workers ready ones (exact: and no other worker, ready or not).
        A worker that died meanwhile is started again on new ports (respawn), unless the caller stopped it."""
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient() as c:
            while time.monotonic() < deadline:
                for name, ch in list(self.workers.items()):
                    if respawn and not ch.alive() and self.respawns < 2 * len(self.workers):
                        # a free port taken by another process between our pick and the engine's bind: new ports
                        self.respawns += 1
                        self.add_worker(name, *self._worker_args[name])
                view = await self.cluster_view(frontend, c)
                if view is not None:
                    ready = [w for w in view["workers"] if w["state"] == "ready"]
                    if len(ready) == n_workers if exact else len(ready) >= n_workers:
                        if not exact or len(view["workers"]) == n_workers:
                            return view
                await asyncio.sleep(0.2)
        raise RuntimeError(f"frontend {frontend} did not see {n_workers} ready workers in {timeout:.0f} s\n{self.logs()}")

    def stop(self) -> None:
        for c in self.frontends.values():
            c.stop(5)
        for c in self.workers.values():
            c.stop(15)


@cache
def _sim_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(SIM_TOKENIZER_DIR / "tokenizer.json"))


def full_blocks(placed: Iterable[tuple[str, str]], block_size: int = WorkerConfig.model_fields["block_size"].default) -> dict[str, int]:
    """worker -> the full blocks of the prompts placed on it, for (worker, prompt) pairs: what a frontend's index must
    hold once the sim workers' KV events for those prompts have all arrived (the sim's tokenizer, `kvyard worker`'s
    default block size). Equal indexes in two frontends are not enough: the first of several event batches makes them equal."""
    tok, need = _sim_tokenizer(), {}
    for worker, prompt in placed:
        need[worker] = need.get(worker, 0) + len(tok.encode(prompt, add_special_tokens=False).ids) // block_size
    return need
