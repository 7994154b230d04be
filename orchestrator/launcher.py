"""Local launcher behind `kvyard up`: N engines as child processes, each under a WorkerSupervisor,
registered in the same discovery the in-process frontend reads (in-memory unless a Redis URL is given).

KV events use ipc:// sockets in a private run directory (removed by `stop`), so nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import tempfile
from pathlib import Path

from orchestrator.config import ClusterConfig
from orchestrator.security.guards import is_loopback
from workers.discovery import Discovery
from workers.registry import create_backend
from workers.vllm.features import lora_launch
from orchestrator.disagg.launch import pd_launch
from workers.process import cpus_but_first
from workers.types import EngineLaunchConfig, WorkerRole
from workers.worker import WorkerOptions, WorkerSupervisor

__all__ = ["LocalCluster", "default_tokenizer", "device_of", "engine_config", "kv_event_endpoints", "port_is_free"]

log = logging.getLogger("kvyard.launcher")


def default_tokenizer(backend: str, model: str, tokenizer: str | None = None) -> str | None:
    """Where the frontend finds the tokenizer of `model` served by `backend` (`tokenizer`: the user's choice)."""
    if tokenizer:
        return tokenizer
    if backend == "sim":
        from workers.sim.backend import SIM_TOKENIZER_DIR as TOKENIZER_DIR

        return str(TOKENIZER_DIR)
    path = Path(model)
    return str(path) if (path / "tokenizer.json").exists() else None


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind `port` on `host` now (a plain bind, as strict as an engine's)."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def kv_event_endpoints(host: str, port: int, run_dir: Path) -> tuple[str, str]:
    """(events, replay) endpoints of an engine bound to `host` (`kvyard worker`), exposed no wider than its HTTP port.

    loopback host     ipc:// sockets in `run_dir` (a private 0700 folder): nothing listens on TCP at all
    wildcard host     tcp://*:port and port + 1 (the engine serves every interface anyway)
    another address   replay on that address; the PUB socket on *: vLLM's publisher (and the sim, faithful to
                      it) binds only wildcard endpoints and *connects* to any other tcp one. Logged; firewall
                      the port or use a loopback/wildcard host."""
    if host == "localhost" or is_loopback(host):
        return f"ipc://{run_dir}/kv-events.sock", f"ipc://{run_dir}/kv-replay.sock"
    if host in ("", "*", "0.0.0.0", "::"):
        return f"tcp://*:{port}", f"tcp://*:{port + 1}"
    log.warning("the engine's KV-event PUB socket binds every interface on port %d (engines bind only wildcard tcp "
                "endpoints); its replay socket binds %s. Firewall port %d, or bind the worker to loopback or 0.0.0.0.",
                port, host, port)
    bracketed = f"[{host}]" if ":" in host else host
    return f"tcp://*:{port}", f"tcp://{bracketed}:{port + 1}"


def engine_config(c: ClusterConfig, port: int, kv_events_endpoint: str | None, kv_replay_endpoint: str | None,
                  host: str = "127.0.0.1") -> EngineLaunchConfig:
    """One engine of the cluster `c` (local processes and Ray actors alike)."""
    extra = list(c.engine_args)
    if c.backend == "sim":
        extra += ["--speedup", str(c.speedup)]
    env: dict[str, str] = {}
    if c.frontend.lora.adapters and c.backend in ("sim", "vllm"):  # adapters are loaded at run time (orchestrator/lora.py)
        lora_args, env = lora_launch(c.frontend.lora.max_per_worker, c.frontend.lora.max_lora_rank)
        extra = lora_args + extra  # the cluster's own engine_args come later and win
    tracing = c.frontend.telemetry.tracing
    if tracing.enabled and c.backend == "vllm" and "--otlp-traces-endpoint" not in extra:  # its spans join the frontend's trace
        extra = ["--otlp-traces-endpoint", tracing.endpoint] + extra
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = tracing.protocol
    return EngineLaunchConfig(model=c.model, served_model_name=c.served_model_name, host=host, port=port, block_size=c.block_size,
                              max_model_len=c.max_model_len, kv_events_endpoint=kv_events_endpoint,
                              kv_replay_endpoint=kv_replay_endpoint, extra_args=extra, cpus=c.engine_cpus,
                              engine_cmd=list(c.engine_cmd) if c.engine_cmd else None, env=env)


def device_of(requested: str | None) -> str:
    """cpu | cuda: the one asked for, else cuda when nvidia-smi is on PATH."""
    import shutil

    return requested or ("cuda" if shutil.which("nvidia-smi") else "cpu")


class LocalCluster:
    def __init__(self, cfg: ClusterConfig, discovery: Discovery) -> None:
        self.cfg = cfg
        self.discovery = discovery
        self.backend = create_backend(cfg.backend, device_of(None if cfg.device == "auto" else cfg.device))
        self.run_dir = Path(tempfile.mkdtemp(prefix="kvyard-"))
        self.supervisors: list[WorkerSupervisor] = []
        self._running: dict[WorkerSupervisor, asyncio.Task] = {}  # each started worker's run loop (lease renewal)
        self._ports: dict[int, int] = {}  # worker index -> engine port

    def engine_port(self, i: int) -> int:
        """Worker i's engine port: base_port + i, or the next free one above it when something else holds it.

        Engines are started together, so a port taken by another program (or an outgoing connection's
        ephemeral port) would otherwise fail the whole `kvyard up`; the URL each worker registers is the one
        it got, so frontends follow. The frontend's own ports are never given to an engine: the engines start
        first, so a free check alone would hand `--port` to worker 0 when it equals `--base-port`."""
        if i not in self._ports:
            f = self.cfg.frontend
            taken = set(self._ports.values()) | {f.port, f.grpc_port}
            port = self.cfg.base_port + i
            while port in taken or not port_is_free(port):
                port += 1
            if port != self.cfg.base_port + i:
                log.warning("port %d is in use: worker %d's engine listens on %d", self.cfg.base_port + i, i, port)
            self._ports[i] = port
        return self._ports[i]

    def _engine_cfg(self, i: int) -> EngineLaunchConfig:
        return engine_config(self.cfg, self.engine_port(i), f"ipc://{self.run_dir}/w{i}-kv.sock", f"ipc://{self.run_dir}/w{i}-replay.sock")

    def roles(self) -> list[WorkerRole]:
        """The role of each worker: prefill_workers + decode_workers when set (disaggregated), else `workers` x both."""
        c = self.cfg
        if c.prefill_workers or c.decode_workers:
            return [WorkerRole.PREFILL] * c.prefill_workers + [WorkerRole.DECODE] * c.decode_workers
        return [WorkerRole.BOTH] * c.workers

    def make_supervisor(self, i: int, role: WorkerRole, tokenizer: str | None) -> WorkerSupervisor:
        """Worker i in `role`: its engine gets the flavor's hand-off flags (orchestrator/disagg/launch.py)."""
        cfg = self._engine_cfg(i)
        cfg.role = role.value
        pd = pd_launch(self.cfg.backend, self.cfg.flavor, role, kv_buffer_device="cpu" if self.vllm_on_cpu else None)
        cfg.extra_args += pd.extra_args
        cfg.env.update(pd.env)
        opts = WorkerOptions(role=role, tokenizer=tokenizer, worker_id=f"{self.cfg.backend}-{role.value}-{i}" if role != WorkerRole.BOTH
                             else f"{self.cfg.backend}-{i}", log_path=str(self.cfg.log_dir / f"worker-{i}.log"),
                             start_timeout_s=self.cfg.engine_start_timeout_s, pd_protocol=pd.pd_protocol, bootstrap_port=pd.bootstrap_port)
        return WorkerSupervisor(self.backend, cfg, self.discovery, opts)

    @property
    def vllm_on_cpu(self) -> bool:
        return self.cfg.backend == "vllm" and getattr(self.backend, "device", None) == "cpu"

    def nixl_on_shared_cpus(self) -> bool:
        """True for vLLM-CPU P/D engines (NixlConnector: a busy-polling UCX thread each) left free to run on every CPU,
        the frontend's included."""
        disagg = any(r != WorkerRole.BOTH for r in self.roles())
        return self.vllm_on_cpu and disagg and self.cfg.flavor == "vllm" and not self.cfg.engine_cpus

    async def start(self) -> None:
        if self.nixl_on_shared_cpus():
            log.warning("vLLM-CPU P/D engines with NixlConnector each keep a core busy (NIXL's UCX progress thread polls "
                        "without pause) and may run on every CPU here, the frontend's too: on a small host requests and "
                        "leases then time out. Give the engines their own CPUs with --engine-cpus (here: %s).",
                        cpus_but_first() or "none to spare, this host has one CPU")
        tok = default_tokenizer(self.cfg.backend, self.cfg.model, self.cfg.tokenizer)
        self.cfg.log_dir.mkdir(parents=True, exist_ok=True)
        for i, role in enumerate(self.roles()):
            self.supervisors.append(self.make_supervisor(i, role, tok))
        results = await asyncio.gather(*(self._start_one(s) for s in self.supervisors), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.stop(drain=False)
            raise errors[0]

    async def _start_one(self, s: WorkerSupervisor) -> None:
        """Start one worker and keep its lease from the moment it registers: engines start at different speeds
        (a vLLM engine can take minutes), and a lease left unrenewed until the slowest is up lapses meanwhile."""
        await s.start()
        self._running[s] = asyncio.create_task(s.run())

    def running(self) -> list[tuple[WorkerSupervisor, asyncio.Task]]:
        """Each started worker and its run loop, in start order."""
        return [(s, self._running[s]) for s in self.supervisors if s in self._running]

    async def stop(self, drain: bool = True) -> None:
        """Stop every worker: the running ones through their run loops (drain, deregister, stop the engine), the
        others (never started, or failed to) directly."""
        for s in self._running:
            s.request_stop()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        idle = [s for s in self.supervisors if s not in self._running]
        await asyncio.gather(*(s.shutdown(drain=drain) for s in idle), return_exceptions=True)
        self._running.clear()
        shutil.rmtree(self.run_dir, ignore_errors=True)  # the engines' KV-event sockets
