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
  stacks    a watch thread wakes every tick_s: once the ticker has not run for stall_s (or the thread itself could
            not run for that long: a C call kept the GIL), it writes every thread's Python stack, with the
            threads' names, to stderr, once per stall. It reads them with `sys._current_frames()`, holding the GIL.
            It used faulthandler's watchdog before: that one writes without the GIL, so it also names a C call
            that keeps it, but it walks a running thread's frames as they change, and a stall on a loaded machine
            killed a frontend with SIGSEGV in the middle of such a dump (tests/integration/test_up_ray.py in CI).
            A C call that keeps the GIL is still named: the dump runs as soon as the GIL is let go, and names the
            thread that held it while that thread lives. Only the first watch started in a process writes stacks;
            later ones (several apps in one test process) only measure.

Off with `loop_stall_s: 0` (FrontendConfig). Costs one timer per tick_s (250 ms) and the watch thread's wake-up.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from typing import TextIO

from prometheus_client import Counter, Histogram

__all__ = ["LoopWatch"]

log = logging.getLogger("kvyard.loop")

_dump_owner: "LoopWatch | None" = None  # the watch whose thread writes stacks (one a process)


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
        self.dump_file = dump_file  # where the stack watch writes; None: sys.stderr at start
        self.worst_s = 0.0  # the longest lag seen
        self._task: asyncio.Task | None = None
        self._loop_ident = 0
        self._tick_at = 0.0
        self._tick_cpu: float | None = None
        self._tick_proc_cpu = 0.0
        self._stop: threading.Event | None = None  # the stack watch thread's stop signal

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
            self._stop = threading.Event()
            threading.Thread(target=self._watch_stacks, args=(self._stop,), name="kvyard-loopwatch-stacks",
                             daemon=True).start()
        self._task = asyncio.get_running_loop().create_task(self._ticker(), name="kvyard-loopwatch")

    async def close(self) -> None:
        global _dump_owner
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if _dump_owner is self:
            self._stop.set()
            _dump_owner = None

    def _watch_stacks(self, stop: threading.Event) -> None:
        """The stack watch thread: every thread's stack, once per stall (see the module's header)."""
        global _dump_owner
        reported = False
        woke = time.monotonic()
        while not stop.wait(self.tick_s):
            now = time.monotonic()
            held = now - woke - self.tick_s  # how late this thread ran: the GIL (or the CPU) was not to be had
            woke = now
            silent = now - self._tick_at  # since the ticker last ran
            if silent < self.stall_s and held < self.stall_s:
                reported = False
            elif not reported:
                reported = True
                try:
                    self._write_stacks(silent, held)
                except Exception as exc:  # a closed or broken file: measuring goes on without stacks
                    log.warning("stall stacks are off: cannot write them to %r (%s)", self.dump_file, exc)
                    if _dump_owner is self:  # the stall log says "no stacks" from now on
                        _dump_owner = None
                    return

    def _write_stacks(self, silent: float, held: float) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        me = threading.get_ident()
        out = [f"kvyard loop watch: the event loop has not turned for {silent:.2f} s (this watch ran {held:.2f} s "
               f"late); every thread's stack, innermost call last:"]
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            what = " (the event loop)" if ident == self._loop_ident else ""
            out.append(f"Thread {ident:#018x} {names.get(ident, '?')}{what}:")
            out.append("".join(traceback.format_stack(frame)).rstrip("\n"))
        self.dump_file.write("\n".join(out) + "\n")
        self.dump_file.flush()

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            now, cpu, proc_cpu = time.monotonic(), _thread_cpu_s(self._loop_ident), time.process_time()
            late = max(0.0, now - self._tick_at - self.tick_s)
            self.lag.observe(late)
            self.worst_s = max(self.worst_s, late)
            if late >= self.stall_s:
                self.stalls.inc()
                # CPU time since the last tick, of the loop's thread and of the whole process (the module's table)
                loop_used = None if cpu is None or self._tick_cpu is None else cpu - self._tick_cpu
                proc_used = proc_cpu - self._tick_proc_cpu
                where = ("every thread's stack was written to stderr during it; the loop's is Thread "
                         f"{self._loop_ident:#018x}" if _dump_owner is self
                         else "no stacks: another watch writes them, or they are off")
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
