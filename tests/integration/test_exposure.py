"""What the processes expose and leave behind (issue #19, classes 3, 7 and 9), over real processes.

    sockets      `kvyard worker --host 127.0.0.1`: nothing of the worker or its engine listens beyond loopback (the
                 KV-event and replay sockets were tcp://* before)
    secrets      the Redis password of --redis-url appears nowhere in a frontend's or a worker's output
    no registry  `kvyard frontend` without --redis-url exits at once, saying what is missing
    cleanup      `kvyard up` leaves no run folder in the temp directory
    hung engine  a SIGSTOPped engine's worker stops renewing its lease (the registry drops it) and registers it
                 again once it answers
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.testing.procs import RedisServer, descendants
from tests.integration.up_admin import ADMIN_HEADERS, admin_env
from orchestrator.testing import free_port, free_port_run
from workers.discovery import InMemoryDiscovery
from workers.registry import get_backend
from workers.types import EngineLaunchConfig
from workers.worker import WorkerOptions, WorkerSupervisor

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KVYARD = [sys.executable, "-m", "orchestrator"]
PASSWORD = "Sup3r-s3cret-redis-passw0rd"


def listening(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state held by these processes (from /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                hexaddr, hexport = f[1].split(":")
                if width == 8:
                    addr = ".".join(str(int(hexaddr[i:i + 2], 16)) for i in (6, 4, 2, 0))
                else:
                    addr = "::1" if hexaddr == "00000000000000000000000001000000" else hexaddr
                out.add((addr, int(hexport, 16)))
    return out


@pytest.fixture
def private_redis(tmp_path):
    r = RedisServer(log_dir=tmp_path)
    r.start()
    yield r
    r.stop()


def _redis_cli(port: int, *args: str) -> None:
    subprocess.run(["redis-cli", "-p", str(port), *args], check=True, capture_output=True)


def _output_until(proc: subprocess.Popen, path: Path, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace")
        if needle in text or proc.poll() is not None:
            return text
        time.sleep(0.2)
    return path.read_text(errors="replace")


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_loopback_worker_listens_on_loopback_only_and_never_prints_the_password(tmp_path, private_redis):
    _redis_cli(private_redis.port, "CONFIG", "SET", "requirepass", PASSWORD)
    url = f"redis://:{PASSWORD}@127.0.0.1:{private_redis.port}/0"
    port, fport = free_port(), free_port()
    worker_log, fe_log = tmp_path / "worker.log", tmp_path / "frontend.log"
    worker = subprocess.Popen([*KVYARD, "--log-level", "debug", "worker", "--backend", "sim", "--model", "h200-llama3.1-8b",
                               "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port), "--redis-url", url,
                               "--", "--speedup", "10"], stdout=open(worker_log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    frontend = subprocess.Popen([*KVYARD, "--log-level", "debug", "frontend", "--port", str(fport), "--grpc-port", "0", "--redis-url", url],
                                stdout=open(fe_log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        text = _output_until(worker, worker_log, "ready at", 90)
        assert "ready at" in text, text[-3000:]
        with httpx.Client(timeout=30) as c:
            deadline = time.monotonic() + 30
            while c.get(f"http://127.0.0.1:{fport}/health").status_code != 200:
                assert time.monotonic() < deadline, fe_log.read_text()[-3000:]
                time.sleep(0.3)
            r = c.post(f"http://127.0.0.1:{fport}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
        bound = listening([worker.pid, *descendants(worker.pid)])
        assert any(p == port for _, p in bound), bound  # the engine's HTTP port is found...
        assert all(addr in ("127.0.0.1", "::1") for addr, _ in bound), bound  # ...and nothing listens beyond loopback
    finally:
        _stop(frontend)
        _stop(worker)
    for log in (worker_log, fe_log):
        text = log.read_text(errors="replace")
        assert text.strip() and PASSWORD not in text, f"{log.name} leaks the Redis password"
    assert "redis://:***@127.0.0.1" in fe_log.read_text()  # the banner still says where discovery is


def test_frontend_without_a_registry_refuses_to_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "KVYARD_REDIS_URL"}
    t0 = time.monotonic()
    proc = subprocess.run([*KVYARD, "frontend", "--port", str(free_port()), "--grpc-port", "0"], capture_output=True, text=True,
                          env=env, timeout=60, cwd=ROOT)
    assert proc.returncode != 0 and time.monotonic() - t0 < 30
    assert "--redis-url" in proc.stderr and "kvyard up" in proc.stderr


def test_up_leaves_no_run_folder(tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    port = free_port()
    log = tmp_path / "up.log"
    proc = subprocess.Popen([*KVYARD, "up", "--workers", "1", "--port", str(port), "--grpc-port", "0", "--base-port", str(free_port_run(8)),
                             "--speedup", "10"], stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=tmp_path,
                            env=admin_env({**os.environ, "TMPDIR": str(tmpdir)}))
    try:
        text = _output_until(proc, log, "Press Ctrl-C", 120)
        assert "Press Ctrl-C" in text, text[-3000:]
        assert [p.name for p in tmpdir.iterdir() if p.name.startswith("kvyard-") and p.name != "kvyard-tokenizers"]
        with httpx.Client(timeout=30, headers=ADMIN_HEADERS) as c:
            assert c.get(f"http://127.0.0.1:{port}/api/cluster").status_code == 200
    finally:
        _stop(proc, signal.SIGINT)
    assert proc.returncode == 0, log.read_text()[-3000:]
    left = [p.name for p in tmpdir.iterdir() if p.name.startswith("kvyard-") and p.name != "kvyard-tokenizers"]
    assert left == [], left


async def test_worker_stops_renewing_a_sigstopped_engine():
    disc = InMemoryDiscovery()
    cfg = EngineLaunchConfig(model="h200-llama3.1-8b", served_model_name="m", port=free_port(), extra_args=["--speedup", "10"])
    sup = WorkerSupervisor(get_backend("sim"), cfg, disc, WorkerOptions(worker_id="w", lease_ttl_s=1.5))
    await sup.start()
    run = asyncio.create_task(sup.run())
    try:
        assert [w.worker_id for w in await disc.list_workers()] == ["w"]
        os.kill(sup.engine.pid, signal.SIGSTOP)  # the worker process itself keeps running (and used to keep renewing)
        t0 = time.monotonic()
        while await disc.list_workers():
            assert time.monotonic() - t0 < 8, "the lease of a stopped engine was still renewed"
            await asyncio.sleep(0.1)
        os.kill(sup.engine.pid, signal.SIGCONT)
        t1 = time.monotonic()
        while not await disc.list_workers():
            assert time.monotonic() - t1 < 8, "the engine answers again but was not registered again"
            await asyncio.sleep(0.1)
    finally:
        os.kill(sup.engine.pid, signal.SIGCONT)
        sup.request_stop()
        await run
