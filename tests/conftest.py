"""Shared fixtures: a Redis server on 127.0.0.1:6379 (started if none answers)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest


def _redis_up(port: int = 6379) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_url() -> str:
    if not _redis_up():
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("no Redis on 127.0.0.1:6379 and no redis-server binary (apt-get install redis-server)")
        subprocess.run([exe, "--daemonize", "yes", "--bind", "127.0.0.1", "--port", "6379", "--save", "", "--appendonly", "no"], check=True)
        deadline = time.monotonic() + 10
        while not _redis_up() and time.monotonic() < deadline:
            time.sleep(0.1)
    return "redis://127.0.0.1:6379/0"
