"""Local launcher behind `kvyard up`: N engines as child processes, each under a WorkerSupervisor,
registered in the same discovery the in-process frontend reads (in-memory unless a Redis URL is given).

KV events use ipc:// sockets in a private run directory, so nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path

from orchestrator.config import ClusterConfig
from workers.discovery import Discovery
from workers.registry import get_backend
from workers.types import EngineLaunchConfig
from workers.worker import WorkerOptions, WorkerSupervisor

__all__ = ["LocalCluster", "default_tokenizer"]

log = logging.getLogger("kvyard.launcher")


def default_tokenizer(backend: str, model: str) -> str | None:
    """Where the frontend finds the tokenizer of `model` served by `backend`."""
    if backend == "sim":
        from workers.sim.backend import SIM_TOKENIZER_DIR as TOKENIZER_DIR

        return str(TOKENIZER_DIR)
    path = Path(model)
    return str(path) if (path / "tokenizer.json").exists() else None


class LocalCluster:
    def __init__(self, cfg: ClusterConfig, discovery: Discovery) -> None:
        self.cfg = cfg
        self.discovery = discovery
        self.backend = get_backend(cfg.backend)
        self.run_dir = Path(tempfile.mkdtemp(prefix="kvyard-"))
        self.supervisors: list[WorkerSupervisor] = []
        self._tasks: list[asyncio.Task] = []

    def _engine_cfg(self, i: int) -> EngineLaunchConfig:
        c = self.cfg
        extra = list(c.engine_args)
        if c.backend == "sim":
            extra += ["--speedup", str(c.speedup)]
        return EngineLaunchConfig(
            model=c.model,
            served_model_name=c.served_model_name,
            port=c.base_port + i,
            block_size=c.block_size,
            max_model_len=c.max_model_len,
            kv_events_endpoint=f"ipc://{self.run_dir}/w{i}-kv.sock",
            kv_replay_endpoint=f"ipc://{self.run_dir}/w{i}-replay.sock",
            extra_args=extra,
        )

    async def start(self) -> None:
        tok = default_tokenizer(self.cfg.backend, self.cfg.model)
        self.cfg.log_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.cfg.workers):
            opts = WorkerOptions(tokenizer=tok, worker_id=f"{self.cfg.backend}-{i}", log_path=str(self.cfg.log_dir / f"worker-{i}.log"))
            self.supervisors.append(WorkerSupervisor(self.backend, self._engine_cfg(i), self.discovery, opts))
        results = await asyncio.gather(*(s.start() for s in self.supervisors), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.stop(drain=False)
            raise errors[0]
        self._tasks = [asyncio.create_task(s.run()) for s in self.supervisors]

    async def stop(self, drain: bool = True) -> None:
        if self._tasks:
            for s in self.supervisors:
                s.request_stop()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        else:
            await asyncio.gather(*(s.shutdown(drain=drain) for s in self.supervisors), return_exceptions=True)
