"""Watch the frontend's event loop: how late it runs, and what held it when it stalled.

Everything the frontend does (requests, streaming, routing, worker leases under `kvyard up`, engine scrapes)
shares one asyncio loop. If that loop stops turning for seconds, engine connections time out and local leases
lapse, and from the outside it looks like the engines failed. Two parts tell which it was:

  ticker    a task that sleeps `tick_s` and measures how late it woke: `kvyard_event_loop_lag_seconds`
            (histogram). A wake-up later than `stall_s` is a stall: counted (`kvyard_event_loop_stalls_total`)
            and logged with the CPU time the loop's thread and the whole process used meanwhile:
              loop thread busy              Python work on the loop held it (the stacks below say which)
              loop idle, process busy       another thread of this process held the GIL (its stack is dumped)
              both idle                     the host did not run the process (CPU starvation), or a system
                                            call blocked
  stacks    each tick re-arms `faulthandler.dump_traceback_later(stall_s)`: if the loop misses it, faulthandler's
            own C thread writes every thread's Python stack (innermost frame first) to stderr, without needing
            the GIL, so it names the holder even when a C call keeps the GIL. faulthandler has one such timer per
            process: the first watch started owns it, later ones (several apps in one test process) only measure.

Off with `loop_stall_s: 0` (FrontendConfig). Costs one timer and one faulthandler re-arm per tick_s (250 ms); a re-arm
starts faulthandler's watchdog thread anew: four thread starts a second.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import sys
import threading
import time
from typing import TextIO

from prometheus_client import Counter, Histogram

__all__ = ["LoopWatch"]

log = logging.getLogger("kvyard.loop")

_dump_owner: "LoopWatch | None" = None  # the watch that holds faulthandler's one dump timer


def _thread_cpu_s(ident: int) -> float | None:
    """CPU seconds the thread `ident` has used (Linux: its pthread CPU clock), or None where that is not available."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError, ValueError):
        return None


class LoopWatch:
    def __init__(self, lag: Histogram, stalls: Counter, stall_s: float = 1.0, tick_s: float = 0.25,
                 dump_file: TextIO | None = None) -> None:
        if stall_s <= 0 or tick_s <= 0:
            raise ValueError("stall_s and tick_s must be positive")
        self.lag, self.stalls = lag, stalls
        self.stall_s, self.tick_s = stall_s, tick_s
        self.dump_file = dump_file  # where faulthandler writes the stacks; None: sys.stderr at start
        self.worst_s = 0.0  # the longest lag seen
        self._task: asyncio.Task | None = None
        self._loop_ident = 0
        self._tick_at = 0.0
        self._tick_cpu: float | None = None
        self._tick_proc_cpu = 0.0

    @property
    def dumps_stacks(self) -> bool:
        return _dump_owner is self

    def start(self) -> None:
        """Start on the running loop (from its thread)."""
        global _dump_owner
        self._loop_ident = threading.get_ident()
        self._tick_at, self._tick_cpu, self._tick_proc_cpu = time.monotonic(), _thread_cpu_s(self._loop_ident), time.process_time()
        if _dump_owner is None:
            _dump_owner = self
            self.dump_file = self.dump_file or sys.stderr
            self._arm()
        self._task = asyncio.get_running_loop().create_task(self._ticker(), name="kvyard-loopwatch")

    async def close(self) -> None:
        global _dump_owner
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if _dump_owner is self:
            faulthandler.cancel_dump_traceback_later()
            _dump_owner = None

    def _arm(self) -> None:
        try:
            faulthandler.dump_traceback_later(self.stall_s + self.tick_s, repeat=False, file=self.dump_file, exit=False)
        except (ValueError, OSError, RuntimeError) as exc:  # a file without a descriptor (some test capture)
            global _dump_owner
            log.warning("stall stacks are off: faulthandler cannot write to %r (%s)", self.dump_file, exc)
            _dump_owner = None

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            if _dump_owner is self:
                self._arm()
            now, cpu, proc_cpu = time.monotonic(), _thread_cpu_s(self._loop_ident), time.process_time()
            late = max(0.0, now - self._tick_at - self.tick_s)
            self.lag.observe(late)
            self.worst_s = max(self.worst_s, late)
            if late >= self.stall_s:
                self.stalls.inc()
                # CPU time since the last tick, of the loop's thread and of the whole process (the module's table)
                loop_used = None if cpu is None or self._tick_cpu is None else cpu - self._tick_cpu
                proc_used = proc_cpu - self._tick_proc_cpu
                where = ("faulthandler wrote every thread's stack to stderr during it; the loop's is Thread "
                         f"{self._loop_ident:#018x}" if _dump_owner is self else "no stacks: another watch holds faulthandler")
                log.warning("the event loop stalled %.2f s (CPU time meanwhile: loop thread %s, whole process %.2f s; %s): engine "
                            "connections and local leases may have timed out meanwhile; %s", late,
                            "unknown" if loop_used is None else f"{loop_used:.2f} s", proc_used,
                            self._diagnosis(loop_used, proc_used, late), where)
            self._tick_at, self._tick_cpu, self._tick_proc_cpu = now, cpu, proc_cpu

    @staticmethod
    def _diagnosis(loop_used: float | None, proc_used: float, late: float) -> str:
        """Which row of the module's table a stall of `late` seconds fits, from the CPU seconds used meanwhile."""
        if loop_used is not None and loop_used >= 0.5 * late:
            return "work on the loop held it"
        if proc_used >= 0.5 * late:
            return "another thread of this process held the GIL"
        return ("the host did not run this process (other processes had the CPUs, e.g. engines busy-polling on the same "
                "cores: give them their own with --engine-cpus), or a system call blocked")
