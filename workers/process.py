"""Run one engine server as a child process: start it, wait until it is healthy, stop it.

Used by `kvyard worker`, by the local launcher behind `kvyard up`, and by the integration tests.
The engine runs in its own process group so that stopping it also stops its helpers.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import httpx

from workers.backend import Backend
from workers.types import EngineLaunchConfig

__all__ = ["EngineProcess", "EngineStartError", "cpus_but_first", "usable_cpus"]


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM the engine if the worker process dies,
    so a SIGKILLed worker leaves no orphan engine holding a GPU."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def usable_cpus(cpus: frozenset[int]) -> frozenset[int]:
    """The CPUs of `cpus` this process may use; EngineStartError when none of them is (a typo'd list must not
    silently run the engine everywhere)."""
    allowed = os.sched_getaffinity(0)
    usable = frozenset(cpus) & allowed
    if not usable:
        raise EngineStartError(f"none of the engine CPUs {sorted(cpus)} is available here (this process may use {sorted(allowed)})")
    return usable


def cpus_but_first() -> str | None:
    """This process's CPUs but the lowest, as a Linux CPU list: what engines get when the first CPU stays the
    frontend's. None with a single CPU."""
    rest = sorted(os.sched_getaffinity(0))[1:]
    return ",".join(map(str, rest)) if rest else None


TAIL_LINES = 40


class EngineStartError(RuntimeError):
    """The engine exited or never became healthy; the message carries the tail of its log."""


class EngineProcess:
    def __init__(self, backend: Backend, cfg: EngineLaunchConfig, log_path: str | Path | None = None) -> None:
        self.backend = backend
        self.cfg = cfg
        self.log_path = Path(log_path) if log_path else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file = None
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)  # without a log file: the engine's last lines of output

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def start(self) -> None:
        spec = self.backend.launch_spec(self.cfg)
        for path, text in spec.files.items():  # e.g. TRT-LLM's --extra_llm_api_options YAML
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        # PYTHONHASHSEED would silently re-seed vLLM's block-hash chain: the engine gets it only if the spec sets it
        inherited = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        env = {**inherited, **spec.env}
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")
            out = self._log_file
        else:  # no log file (`kvyard worker`): the engine's output goes on to this process's (a container's log),
            out = subprocess.PIPE  # through a thread that keeps its last lines for error reports
        cpus = usable_cpus(self.cfg.cpus) if self.cfg.cpus else None

        def before_exec() -> None:
            _die_with_parent()
            if cpus:  # inherited by every thread and child process the engine starts
                os.sched_setaffinity(0, cpus)

        self._proc = subprocess.Popen(
            spec.argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=before_exec,
        )
        if out is subprocess.PIPE:
            threading.Thread(target=self._forward, args=(self._proc.stdout,), daemon=True, name="engine-output").start()

    def _forward(self, stream) -> None:
        """Copy the engine's output to ours line by line, keeping the last TAIL_LINES."""
        sink = getattr(sys.stdout, "buffer", None)
        for line in iter(stream.readline, b""):
            self._tail.append(line.decode(errors="replace").rstrip("\n"))
            if sink is not None:
                try:
                    sink.write(line)
                    sink.flush()
                except (OSError, ValueError):
                    sink = None
        stream.close()

    def log_tail(self, n: int = 40) -> str:
        if not self.log_path:
            time.sleep(0.05)  # let the forwarding thread take the last lines of an engine that just exited
            return "\n".join(list(self._tail)[-n:]) or "(the engine printed nothing)"
        if not self.log_path.exists():
            return "(no log)"
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    async def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.returncode is not None:
                    raise EngineStartError(
                        f"{self.backend.name} engine exited with code {self.returncode}:\n{self.log_tail()}"
                    )
                try:
                    r = await client.get(self.url + self.backend.health_path)
                    if r.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
        raise EngineStartError(f"{self.backend.name} engine not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def _signal(self, sig: int) -> None:
        if self._proc and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                pass

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL after `grace` seconds."""
        if self._proc is None:
            return
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self._proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._proc.poll() is None:
            self._signal(signal.SIGKILL)
            while self._proc.poll() is None:
                await asyncio.sleep(0.05)
        if self._log_file:
            self._log_file.close()
            self._log_file = None

    def kill(self) -> None:
        """Synchronous SIGKILL (atexit and fault-injection paths)."""
        self._signal(signal.SIGKILL)
