"""The worker process: one engine, registered under a lease, drained on shutdown.

Lifecycle (`kvyard worker`, and each worker of `kvyard up`):
    start engine -> wait healthy -> [start the KV-event relay] -> register(info, ttl) -> renew every ttl/3
    (the renewal rewrites the whole entry, so one damaged in the registry heals within ttl/3)
The engine's health is checked every ttl/3 too: one that fails `health_failures` checks in a row (hung,
SIGSTOPped, wedged) has its lease left to lapse, so every frontend drops it within one ttl even if it
still accepts connections; once it answers again the worker registers it anew.
    SIGTERM -> state=draining (frontends stop sending) -> wait until the engine has nothing running
            (or drain_timeout) -> deregister -> stop engine
If the engine dies, the worker deregisters at once and exits non-zero. If discovery is unreachable,
the worker keeps serving and keeps retrying the renewal; the lease is re-created when it is back.

Failures are reported, not only logged: an engine that exits while starting, is not healthy within
start_timeout_s, exits while serving, or whose KV events stay unreadable (the relay gives up) makes
the worker log the error with the engine's log tail, write a WorkerFailure to discovery (frontends
show it on /api/cluster), deregister and exit non-zero.

KV-event relay: a backend with `kv_events_transport == "http-relay"` (TensorRT-LLM: its events are
drained by each read) gets one reader, this process, which republishes them on the worker's KV-event
endpoint in vLLM's wire format (workers/trtllm/relay.py); the worker registers that endpoint with
label kv_events_format=vllm, so any number of frontends subscribe as to a vLLM engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from workers.backend import Backend
from workers.discovery import Discovery, DiscoveryError
from workers.process import EngineProcess, EngineStartError
from workers.types import EngineLaunchConfig, WorkerFailure, WorkerInfo, WorkerRole, WorkerState, task_of_engine_args

__all__ = ["WorkerSupervisor", "WorkerOptions", "TOKENIZER_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

log = logging.getLogger("kvyard.worker")


@dataclass(slots=True)
class WorkerOptions:
    role: WorkerRole = WorkerRole.BOTH
    lease_ttl_s: float = 6.0
    drain_timeout_s: float = 60.0
    # a real engine loads weights, allocates KV and warms up first (minutes for a large model, or for
    # two vLLM-CPU engines sharing two cores); the supervisor gives up on one not healthy by then
    start_timeout_s: float = 600.0
    advertise_host: str | None = None  # host frontends use to reach the engine (default: cfg.host)
    tokenizer: str | None = None
    worker_id: str | None = None
    log_path: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    pd_protocol: str | None = None  # P/D hand-off protocol to register (orchestrator/disagg/launch.py)
    bootstrap_port: int | None = None  # SGLang prefill engines: their bootstrap server's port
    health_failures: int = 2  # failed health checks in a row before the lease is left to lapse; 0: never checked


class WorkerSupervisor:
    def __init__(self, backend: Backend, cfg: EngineLaunchConfig, discovery: Discovery, opts: WorkerOptions) -> None:
        self.backend = backend
        self.cfg = cfg
        self.discovery = discovery
        self.opts = opts
        self.worker_id = opts.worker_id or f"{backend.name}-{uuid.uuid4().hex[:8]}"
        self.engine = EngineProcess(backend, cfg, opts.log_path)
        self.info: WorkerInfo | None = None
        self.relay = None  # workers.trtllm.relay.KvEventRelay when the backend's events need one reader
        self._relay_task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._unhealthy = 0  # failed engine health checks in a row

    def _endpoint_for_clients(self, endpoint: str | None) -> str | None:
        if not endpoint:
            return None
        host = self.opts.advertise_host or self.cfg.host
        return endpoint.replace("*", host)

    def build_info(self) -> WorkerInfo:
        host = self.opts.advertise_host or self.cfg.host
        labels = dict(self.opts.labels)
        events, replay = self.cfg.kv_events_endpoint, self.cfg.kv_replay_endpoint
        if self.relay is not None:
            labels["kv_events_format"] = "vllm"  # what the relay republishes
            events, replay = self.relay.endpoint, self.relay.replay_endpoint
        return WorkerInfo(
            worker_id=self.worker_id,
            model=self.cfg.served_model_name,
            backend=self.backend.name,
            role=self.opts.role,
            task=task_of_engine_args(self.cfg.extra_args),
            url=f"http://{host}:{self.cfg.port}",
            block_size=self.cfg.block_size,
            max_model_len=self.cfg.max_model_len,
            tokenizer=self.opts.tokenizer,
            kv_events_endpoint=self._endpoint_for_clients(events),
            kv_replay_endpoint=self._endpoint_for_clients(replay),
            kv_events_topic=self.cfg.kv_events_topic,
            labels=labels,
            pd_protocol=self.opts.pd_protocol,
            bootstrap_port=self.opts.bootstrap_port,
        )

    async def start(self) -> WorkerInfo:
        """Start the engine and register it once healthy. EngineStartError (reported to discovery) if it is not."""
        try:
            self.engine.start()
            await self.engine.wait_healthy(self.opts.start_timeout_s)
        except (EngineStartError, OSError, ValueError) as exc:  # ValueError: a launch config the backend refuses
            log.error("worker %s: %s engine failed to start: %s", self.worker_id, self.backend.name, exc)
            await self.report_failure("start", str(exc))
            if not isinstance(exc, EngineStartError):  # e.g. the engine's program does not exist
                raise EngineStartError(f"cannot start the {self.backend.name} engine: {exc}") from exc
            raise
        self._start_relay()
        self.info = self.build_info()
        try:
            await self.discovery.register(self.info, self.opts.lease_ttl_s)
        except DiscoveryError as exc:  # e.g. Redis restarting: the run loop's first renewal registers it once it answers
            log.warning("cannot register %s yet (%s); it registers on its first lease renewal", self.worker_id, exc)
            return self.info
        await self._publish_tokenizer()
        log.info("worker %s registered: %s %s at %s", self.worker_id, self.backend.name, self.info.model, self.info.url)
        return self.info

    def _start_relay(self) -> None:
        if getattr(self.backend, "kv_events_transport", "zmq") != "http-relay" or not self.cfg.kv_events_endpoint:
            return
        from workers.trtllm.relay import KvEventRelay, RelaySettings

        self.relay = KvEventRelay(self.engine.url, RelaySettings(self.cfg.kv_events_endpoint, self.cfg.kv_replay_endpoint,
                                                                 self.cfg.kv_events_topic))
        self.relay.start()
        self._relay_task = asyncio.get_running_loop().create_task(self.relay.run(), name=f"kv-relay-{self.worker_id}")
        log.info("worker %s: relaying the engine's KV events on %s", self.worker_id, self.relay.endpoint)

    async def report_failure(self, phase: str, error: str) -> None:
        """Tell frontends (via discovery) why this worker is gone; never raises."""
        failure = WorkerFailure(worker_id=self.worker_id, backend=self.backend.name, model=self.cfg.served_model_name,
                                role=self.opts.role, url=self.engine.url, phase=phase, error=error[-4000:])
        try:
            await self.discovery.report_failure(failure)
        except DiscoveryError as exc:
            log.warning("cannot report the failure of %s: %s", self.worker_id, exc)

    async def _publish_tokenizer(self) -> None:
        """Share the tokenizer through discovery so frontends on other hosts can tokenize."""
        if not self.opts.tokenizer:
            return
        folder = Path(self.opts.tokenizer)
        files = {n: (folder / n).read_bytes() for n in TOKENIZER_FILES if (folder / n).is_file()}
        if "tokenizer.json" not in files:
            log.warning("no tokenizer.json in %s: frontends will route without token ids", folder)
            return
        try:
            await self.discovery.publish_files(self.cfg.served_model_name, files)
        except DiscoveryError as exc:
            log.warning("cannot publish the tokenizer of %s: %s", self.cfg.served_model_name, exc)

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        """Keep the lease alive until stop is requested or the engine dies. Returns an exit code."""
        interval = self.opts.lease_ttl_s / 3
        code = 0
        # the engine's health is checked on its own schedule, so a slow answer never delays a renewal
        health = asyncio.create_task(self._watch_health(interval)) if self.opts.health_failures else None
        try:
            while not self._stop.is_set():
                if self.engine.returncode is not None:
                    tail = self.engine.log_tail()
                    log.error("engine of %s exited with %s:\n%s", self.worker_id, self.engine.returncode, tail)
                    await self.report_failure("serving", f"{self.backend.name} engine exited with code {self.engine.returncode}:\n{tail}")
                    code = 1
                    break
                if self._relay_task is not None and self._relay_task.done():
                    exc = self._relay_task.exception() if not self._relay_task.cancelled() else None
                    log.error("worker %s: KV-event relay stopped: %s", self.worker_id, exc)
                    await self.report_failure("serving", f"KV events unreadable: {exc}")
                    code = 1
                    break
                if self._unhealthy < self.opts.health_failures or not self.opts.health_failures:
                    await self._renew()
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout=interval)
                except asyncio.TimeoutError:
                    pass
        finally:
            if health is not None:
                health.cancel()
                await asyncio.gather(health, return_exceptions=True)
        await self.shutdown(drain=code == 0)
        return code

    async def _watch_health(self, interval: float) -> None:
        """GET the engine's health every `interval` (timeout: at least 1 s); `health_failures` failures in a row stop
        the lease renewals until it answers again."""
        timeout_s = max(1.0, min(2.0, self.opts.lease_ttl_s / 2))
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            while True:
                try:
                    ok = (await client.get(self.engine.url + self.backend.health_path)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    if self._unhealthy >= self.opts.health_failures:
                        log.warning("engine of %s answers its health check again: renewing its lease", self.worker_id)
                        await self._renew()  # at once, not at the next tick
                    self._unhealthy = 0
                else:
                    self._unhealthy += 1
                    if self._unhealthy == self.opts.health_failures:
                        log.error("engine of %s failed %d health checks in a row: its lease is no longer renewed, so "
                                  "frontends stop routing to it", self.worker_id, self._unhealthy)
                await asyncio.sleep(interval)

    async def _renew(self) -> None:
        assert self.info is not None
        try:
            if not await self.discovery.renew(self.worker_id, self.opts.lease_ttl_s, info=self.info):
                log.warning("lease of %s had lapsed; registered again", self.worker_id)
                await self._publish_tokenizer()  # a Redis restarted empty lost the tokenizer files too
        except DiscoveryError as exc:
            log.warning("cannot renew lease of %s (will retry): %s", self.worker_id, exc)

    async def _inflight(self, client: httpx.AsyncClient) -> float:
        try:
            r = await client.get(self.engine.url + self.backend.metrics_path)
            m = self.backend.parse_metrics(r.text)
            return m.num_requests_running + m.num_requests_waiting
        except httpx.HTTPError:
            return 0.0

    async def shutdown(self, drain: bool = True) -> None:
        """Drain (state=draining, wait for in-flight to finish), deregister, stop the engine."""
        if self.info is not None and drain:
            self.info = self.info.model_copy(update={"state": WorkerState.DRAINING})
            try:
                await self.discovery.set_state(self.worker_id, WorkerState.DRAINING)
            except DiscoveryError as exc:
                log.warning("cannot mark %s draining: %s", self.worker_id, exc)
            deadline = time.monotonic() + self.opts.drain_timeout_s
            async with httpx.AsyncClient(timeout=2.0) as client:
                # frontends refresh their view about once a second: give them time to stop routing here
                await asyncio.sleep(1.5)
                while time.monotonic() < deadline and await self._inflight(client) > 0:
                    await asyncio.sleep(0.2)
        try:
            await self.discovery.deregister(self.worker_id)
        except DiscoveryError as exc:
            log.warning("cannot deregister %s (its lease will lapse): %s", self.worker_id, exc)
        if self._relay_task is not None:
            self._relay_task.cancel()
            await asyncio.gather(self._relay_task, return_exceptions=True)
        if self.relay is not None:
            await self.relay.close()
            self.relay = None
        await self.engine.stop()
        log.info("worker %s stopped", self.worker_id)
