"""The event-loop watch: a blocked loop is counted and measured, and every thread's stack is written while it lasts
(the holder named even when a C call keeps the GIL); a turning loop reports nothing."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from orchestrator.loopwatch import LoopWatch


def _watch(tmp_path: Path, stall_s: float = 0.4) -> tuple[LoopWatch, CollectorRegistry]:
    r = CollectorRegistry()
    lag = Histogram("lag_seconds", "lag", buckets=(0.01, 0.1, 1, 10), registry=r)
    stalls = Counter("stalls", "stalls", registry=r)
    return LoopWatch(lag, stalls, stall_s=stall_s, tick_s=0.05, dump_file=open(tmp_path / "stacks.txt", "w")), r


def _cpu(message: str, who: str) -> float:
    return float(message.split(who + " ")[1].split(" s")[0])


def _stalls(caplog) -> list[str]:
    return [rec.getMessage() for rec in caplog.records if "stalled" in rec.getMessage()]


def _hold_the_loop_sleeping(seconds: float) -> None:
    time.sleep(seconds)  # a blocking call on the loop's thread: off the CPU


def _hold_the_loop_computing(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def test_a_blocked_loop_is_counted_and_its_stack_dumped(tmp_path, caplog) -> None:
    watch, r = _watch(tmp_path)
    caplog.set_level(logging.WARNING, logger="kvyard.loop")
    watch.start()
    assert watch.dumps_stacks
    try:
        await asyncio.sleep(0.2)
        _hold_the_loop_sleeping(1.0)
        await asyncio.sleep(0.2)  # the ticker wakes late and reports
    finally:
        await watch.close()
    assert r.get_sample_value("stalls_total") == 1
    assert 0.8 <= watch.worst_s < 3.0
    assert r.get_sample_value("lag_seconds_count") >= 4
    [stalled] = _stalls(caplog)
    assert _cpu(stalled, "loop thread") < 0.3, stalled  # off the CPU: a blocking call
    assert "a system call blocked" in stalled
    stacks = (tmp_path / "stacks.txt").read_text()
    assert "_hold_the_loop_sleeping" in stacks, stacks
    assert f"Thread {threading.get_ident():#018x}" in stacks and f"{threading.get_ident():#018x}" in stalled


async def _stall(watch: LoopWatch, hold, seconds: float) -> None:
    """Start the watch, hold its loop for `seconds` with `hold`, let the ticker wake late and report, close it."""
    watch.start()
    try:
        await asyncio.sleep(0.1)
        hold(seconds)
        await asyncio.sleep(0.2)
    finally:
        await watch.close()


async def test_cpu_work_on_the_loop_shows_as_loop_cpu_time(tmp_path, caplog) -> None:
    """Stacks are read with the GIL held (sys._current_frames): a loop busy in Python is sampled mid-work, safely,
    and a long stall gives one dump, not one per tick."""
    watch, r = _watch(tmp_path)
    caplog.set_level(logging.WARNING, logger="kvyard.loop")
    await _stall(watch, _hold_the_loop_computing, 0.8)
    [stalled] = _stalls(caplog)
    assert _cpu(stalled, "loop thread") >= 0.6, stalled
    stacks = (tmp_path / "stacks.txt").read_text()
    assert "(the event loop)" in stacks and "_hold_the_loop_computing" in stacks
    assert 1 <= stacks.count("has not turned for") <= 3, stacks  # not one a tick (~16); a starved machine may add one


async def test_another_thread_holding_the_gil_is_named(tmp_path, caplog) -> None:
    """The loop idles while the process works; the stacks are written as soon as the GIL is let go, and name the
    thread that held it (a pool thread, as a tokenizer's: it lives on after its call)."""
    watch, r = _watch(tmp_path)
    caplog.set_level(logging.WARNING, logger="kvyard.loop")
    release = threading.Event()

    def gil_holder() -> None:
        sum(range(10**8))  # one C call: holds the GIL for about a second, never hands it to the loop
        release.wait(10)

    def stacks_written() -> None:
        deadline = time.monotonic() + 10
        while not (tmp_path / "stacks.txt").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)

    watch.start()
    try:
        await asyncio.sleep(0.1)
        t = threading.Thread(target=gil_holder, name="gil-holder")
        t.start()
        await asyncio.to_thread(stacks_written)
        release.set()
        await asyncio.to_thread(t.join)
        await asyncio.sleep(0.2)
    finally:
        release.set()
        await watch.close()
    [stalled] = _stalls(caplog)
    assert _cpu(stalled, "whole process") - _cpu(stalled, "loop thread") >= 0.3, stalled  # the process worked, the loop did not
    stacks = (tmp_path / "stacks.txt").read_text()
    assert "gil-holder" in stacks, stacks


async def test_a_turning_loop_reports_no_stall(tmp_path, caplog) -> None:
    watch, r = _watch(tmp_path, stall_s=2.0)
    caplog.set_level(logging.WARNING, logger="kvyard.loop")
    watch.start()
    try:
        for _ in range(10):
            _hold_the_loop_sleeping(0.02)  # short holds are lag, not stalls
            await asyncio.sleep(0.03)
    finally:
        await watch.close()
    assert r.get_sample_value("stalls_total") == 0
    assert not caplog.records
    assert watch.worst_s < 2.0
    assert (tmp_path / "stacks.txt").read_text() == ""


async def test_only_the_first_watch_owns_the_stack_dumps(tmp_path) -> None:
    first, _ = _watch(tmp_path)
    second, _ = _watch(tmp_path)
    first.start()
    second.start()
    try:
        assert first.dumps_stacks and not second.dumps_stacks
    finally:
        await first.close()
        await second.close()
    third, _ = _watch(tmp_path)
    third.start()
    assert third.dumps_stacks  # released on close
    await third.close()


@pytest.mark.parametrize("loop_cpu,proc_cpu,case", [
    (1.8, 1.9, "work on the loop held it"),
    (0.1, 1.9, "another thread of this process held the GIL"),
    (0.1, 0.2, "the host did not run this process"),
    (None, 0.2, "the host did not run this process"),  # no per-thread clock: judged on the process alone
])
def test_a_stall_is_told_apart_by_where_the_cpu_time_went(loop_cpu, proc_cpu, case) -> None:
    assert LoopWatch._diagnosis(loop_cpu, proc_cpu, late=2.0).startswith(case)


def test_bad_settings_are_refused() -> None:
    r = CollectorRegistry()
    lag, stalls = Histogram("l", "l", registry=r), Counter("s", "s", registry=r)
    with pytest.raises(ValueError):
        LoopWatch(lag, stalls, stall_s=0)


async def test_a_stack_file_that_cannot_be_written_turns_the_stacks_off(tmp_path, caplog) -> None:
    watch, r = _watch(tmp_path)
    watch.dump_file.close()  # every write now raises
    caplog.set_level(logging.WARNING, logger="kvyard.loop")
    await _stall(watch, _hold_the_loop_sleeping, 0.8)
    assert not watch.dumps_stacks
    assert any("stall stacks are off" in rec.getMessage() for rec in caplog.records)
    [stalled] = _stalls(caplog)
    assert r.get_sample_value("stalls_total") == 1 and "no stacks" in stalled, stalled
