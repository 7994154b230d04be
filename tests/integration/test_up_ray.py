"""`kvyard up --ray` for real: the command runs as a subprocess, its workers are Ray actors running
simulated engines, the in-process frontend finds them through the Ray discovery hub and serves.

1. joined cluster: this test process starts a local Ray cluster (ray.init) and `kvyard up --ray
   --address <its GCS> --planner` joins it; we watch its named actors from here. A completion is
   served; targets with min_replicas 2 make the planner add an actor, max_replicas 1 makes it drain
   and remove one; SIGINT leaves no kvyard actor behind.
2. private cluster: `kvyard up --ray` without --address starts its own local Ray cluster, serves a
   completion and exits cleanly on SIGINT.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from orchestrator.testing.ray_local import start_local_ray

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KVYARD = [sys.executable, "-m", "orchestrator"]
TOKEN = "ray-test-admin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"kvyard up exited with {proc.returncode} while waiting for {what}")
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def start_up(tmp_path: Path, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "KVYARD_ADMIN_TOKEN": TOKEN, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    env.pop("KVYARD_REDIS_URL", None)
    env.pop("RAY_ADDRESS", None)  # set by this process's ray.init; the command must only use --address  # in-memory frontend + the Ray discovery hub
    log = open(tmp_path / "up.log", "wb")
    return subprocess.Popen([*KVYARD, "up", "--ray", "--port", str(port), "--grpc-port", "0", "--speedup", "20",
                             "--served-model-name", "raysim", *extra], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)


def serving(base: str) -> bool:
    try:
        return httpx.get(f"{base}/v1/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def complete(base: str) -> dict:
    r = httpx.post(f"{base}/v1/completions", json={"model": "raysim", "prompt": "hello ray", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200, r.text
    return {"worker": r.headers.get("x-kvyard-worker"), **r.json()}


def put_targets(base: str, lo: int, hi: int) -> None:
    body = {"pools": [{"model": "raysim", "role": "both", "min_replicas": lo, "max_replicas": hi}]}
    r = httpx.put(f"{base}/admin/targets", content=json.dumps(body), headers={"authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 200, r.text


def stop(proc: subprocess.Popen, tmp_path: Path) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise AssertionError("kvyard up did not stop within 120 s:\n" + (tmp_path / "up.log").read_text()[-3000:])


@pytest.fixture(scope="module")
def ray_cluster():
    ray = start_local_ray(num_cpus=3)  # once more if Ray's 30 s start-up window runs out on a loaded machine
    yield ray
    ray.shutdown()


def kvyard_actors(ray) -> dict[str, list[str]]:
    """Live named kvyard actors: {"workers": [...], "hubs": [...]}."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "kvyard"]
    return {"workers": sorted(n for n in names if "-ray-" in n), "hubs": sorted(n for n in names if n.endswith(":discovery"))}


def test_up_ray_serves_and_planner_scales_actors(ray_cluster, tmp_path):
    ray = ray_cluster
    address = ray.get_runtime_context().gcs_address
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_up(tmp_path, port, "--address", address, "--workers", "1", "--planner", "--planner-interval", "1",
                    "--actor-cpus", "0.5")
    try:
        wait_for(lambda: serving(base), 240, "the frontend", proc)
        actors = wait_for(lambda: (a := kvyard_actors(ray)) and len(a["workers"]) == 1 and a, 60, "one worker actor", proc)
        assert len(actors["hubs"]) == 1
        first = wait_for(lambda: complete(base), 60, "a completion", proc)
        assert first["choices"][0]["text"] is not None and first["usage"]["completion_tokens"] >= 1
        assert first["worker"].startswith("sim-ray-")

        put_targets(base, 2, 3)  # the planner must add a replica (clamped up to min_replicas)
        two = wait_for(lambda: len(kvyard_actors(ray)["workers"]) == 2 and kvyard_actors(ray)["workers"], 180, "a second actor", proc)
        seen = wait_for(lambda: len({complete(base)["worker"] for _ in range(12)}) == 2, 120, "both actors serving", proc)
        assert seen

        put_targets(base, 1, 1)  # ... and drain and remove one (clamped down to max_replicas)
        one = wait_for(lambda: len(kvyard_actors(ray)["workers"]) == 1 and kvyard_actors(ray)["workers"], 120, "back to one actor", proc)
        assert set(one) < set(two)
        assert complete(base)["worker"].startswith("sim-ray-")
    finally:
        rc = stop(proc, tmp_path)
    assert rc == 0, (tmp_path / "up.log").read_text()[-3000:]
    assert kvyard_actors(ray) == {"workers": [], "hubs": []}


def test_up_ray_private_local_cluster(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_up(tmp_path, port, "--workers", "1", "--ray-num-cpus", "1")
    try:
        wait_for(lambda: serving(base), 240, "the frontend", proc)
        out = wait_for(lambda: complete(base), 60, "a completion", proc)
        assert out["usage"]["completion_tokens"] >= 1
    finally:
        rc = stop(proc, tmp_path)
    assert rc == 0, (tmp_path / "up.log").read_text()[-3000:]
    assert "started a local Ray cluster" in (tmp_path / "up.log").read_text()
