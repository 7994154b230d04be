"""LocalConnector: scales pools of WorkerSupervisors running in this process (`kvyard up`).

Scale up: `factory(pool, ordinal)` builds a new supervisor; it starts in the background (engine
start, health wait, register) and counts as a replica from that moment.
Scale down: starting workers go first (stopped at once: they never took a request), then the newest
running ones get `request_stop()`, whose `run()` drains them — state=draining so frontends stop
routing there, in-flight requests finish (up to the worker's drain_timeout), deregister, stop the
engine. Draining workers no longer count. A worker whose engine dies drops out of the count, so
the next tick replaces it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from planner.telemetry.schema import PoolKey
from workers.worker import WorkerSupervisor

__all__ = ["LocalConnector", "SupervisorFactory"]

log = logging.getLogger("kvyard.planner.local")

SupervisorFactory = Callable[[PoolKey, int], WorkerSupervisor]


@dataclass(eq=False)
class _Managed:
    pool: PoolKey
    sup: WorkerSupervisor
    task: asyncio.Task | None = None
    state: str = "starting"  # starting | running | draining


class LocalConnector:
    name = "local"

    def __init__(self, factory: SupervisorFactory, first_ordinal: int = 0) -> None:
        self.factory = factory
        self._next = first_ordinal
        self._workers: list[_Managed] = []

    def adopt(self, pool: PoolKey, sup: WorkerSupervisor, task: asyncio.Task) -> None:
        """Take over a worker that is already running (e.g. the ones `kvyard up` started)."""
        m = _Managed(pool, sup, None, "running")
        m.task = asyncio.create_task(self._watch(m, task))
        self._workers.append(m)

    def active(self, pool: PoolKey) -> list[_Managed]:
        return [m for m in self._workers if m.pool == pool and m.state != "draining"]

    def draining(self) -> list[_Managed]:
        return [m for m in self._workers if m.state == "draining"]

    async def get_replicas(self) -> dict[PoolKey, int]:
        out: dict[PoolKey, int] = {}
        for m in self._workers:
            out.setdefault(m.pool, 0)
            if m.state != "draining":
                out[m.pool] += 1
        return out

    async def set_replicas(self, targets: dict[PoolKey, int]) -> dict[PoolKey, int]:
        for pool, n in targets.items():
            cur = self.active(pool)
            for _ in range(n - len(cur)):
                self._spawn(pool)
            if n < len(cur):
                victims = sorted(cur, key=lambda m: (m.state != "starting", -self._workers.index(m)))[: len(cur) - n]
                for m in victims:
                    self._retire(m)
        return {pool: len(self.active(pool)) for pool in targets}

    def _spawn(self, pool: PoolKey) -> None:
        sup = self.factory(pool, self._next)
        self._next += 1
        m = _Managed(pool, sup)
        m.task = asyncio.create_task(self._lifecycle(m))
        self._workers.append(m)
        log.info("starting worker %s for %s", sup.worker_id, pool)

    def _retire(self, m: _Managed) -> None:
        was = m.state
        m.state = "draining"
        if was == "starting":
            assert m.task is not None
            m.task.cancel()  # _lifecycle stops the engine without draining: it never served
        else:
            m.sup.request_stop()  # run() drains, deregisters, stops the engine
        log.info("retiring worker %s of %s (%s)", m.sup.worker_id, m.pool, "was starting" if was == "starting" else "draining")

    async def _lifecycle(self, m: _Managed) -> None:
        try:
            await m.sup.start()
            if m.state == "starting":
                m.state = "running"
            code = await m.sup.run()
            if code:
                log.warning("worker %s exited with %s", m.sup.worker_id, code)
        except asyncio.CancelledError:
            await m.sup.shutdown(drain=False)
        except Exception as exc:  # engine failed to start: drop it, the planner will try again
            log.warning("worker %s failed: %s", m.sup.worker_id, exc)
            await m.sup.shutdown(drain=False)
        finally:
            self._workers.remove(m)

    async def _watch(self, m: _Managed, task: asyncio.Task) -> None:
        try:
            await asyncio.shield(task)
        finally:
            if m in self._workers:
                self._workers.remove(m)

    async def wait_started(self, timeout: float = 120.0) -> None:
        """Until no worker is still starting (tests and `kvyard up`)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while any(m.state == "starting" for m in self._workers):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("workers still starting")
            await asyncio.sleep(0.1)

    async def wait_drained(self, timeout: float = 120.0) -> None:
        tasks = [m.task for m in self.draining() if m.task is not None]
        if tasks:
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout)

    async def close(self, drain: bool = True) -> None:
        for m in list(self._workers):
            if m.state != "draining":
                if drain:
                    self._retire(m)
                else:
                    m.state = "draining"
                    m.sup.request_stop()
        await asyncio.gather(*(m.task for m in list(self._workers) if m.task is not None), return_exceptions=True)
