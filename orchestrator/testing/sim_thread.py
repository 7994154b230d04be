"""The sim engine (workers/sim) served by uvicorn in a thread on a free 127.0.0.1 port: a real engine for
in-process frontend tests, without a child process.

    with ThreadedSim("--runner", "pooling") as sim:
        info = sim.info("w1")   # its registry entry (model "m", the sim's tokenizer, its task)
"""

from __future__ import annotations

import threading
import time

import uvicorn

from orchestrator.testing.fake_engine import free_port
from workers.sim.backend import SIM_TOKENIZER_DIR
from workers.sim.config import parse_args
from workers.sim.server import build_app
from workers.types import WorkerInfo, task_of_engine_args

__all__ = ["ThreadedSim"]


class ThreadedSim:
    def __init__(self, *args: str, model: str = "m", max_model_len: int = 4096) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model, self.max_model_len, self.args = model, max_model_len, list(args)
        cfg = parse_args(["--port", str(self.port), "--served-model-name", model, "--max-model-len", str(max_model_len),
                          "--speedup", "50", *args])
        self.app = build_app(cfg)
        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error", lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def info(self, worker_id: str) -> WorkerInfo:
        return WorkerInfo(worker_id=worker_id, model=self.model, backend="sim", url=self.url, block_size=16,
                          max_model_len=self.max_model_len, tokenizer=str(SIM_TOKENIZER_DIR), task=task_of_engine_args(self.args))

    def __enter__(self) -> "ThreadedSim":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the sim did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(5)
