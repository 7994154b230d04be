"""The replay's virtual clock: event order is by time, then priority, then first scheduled first."""

from __future__ import annotations

import pytest

from orchestrator.replay.clock import VirtualClock


def test_time_order_regardless_of_scheduling_order():
    c, seen = VirtualClock(), []
    for t in (3.0, 1.0, 2.0, 0.5):
        c.at(t, seen.append, t)
    c.run()
    assert seen == [0.5, 1.0, 2.0, 3.0]
    assert c.now == 3.0 and c.events_run == 4


@pytest.mark.parametrize("prios, expected", [
    ((0, 0, 0), ["a", "b", "c"]),  # ties: first scheduled first
    ((1, 0, 2), ["b", "a", "c"]),  # lower priority value first at equal times
    ((2, 2, 1), ["c", "a", "b"]),
])
def test_equal_times_priority_then_fifo(prios, expected):
    c, seen = VirtualClock(), []
    for name, p in zip("abc", prios):
        c.at(5.0, seen.append, name, priority=p)
    c.run()
    assert seen == expected


def test_event_scheduled_for_now_runs_after_those_already_queued_for_now():
    c, seen = VirtualClock(), []

    def first():
        seen.append("first")
        c.at(c.now, seen.append, "nested")  # same time, scheduled later

    c.at(1.0, first)
    c.at(1.0, seen.append, "second")
    c.at(1.5, seen.append, "later")
    c.run()
    assert seen == ["first", "second", "nested", "later"]


def test_handlers_see_their_own_time_and_after_is_relative():
    c, seen = VirtualClock(), []
    c.at(2.0, lambda: c.after(0.25, lambda: seen.append(c.now)))
    c.run()
    assert seen == [2.25]
    assert c() == 2.25  # the clock is a callable time source


def test_past_and_negative_scheduling_refused():
    c = VirtualClock()
    c.at(1.0, lambda: None)
    c.run()
    with pytest.raises(ValueError):
        c.at(0.5, lambda: None)
    with pytest.raises(ValueError):
        c.after(-0.1, lambda: None)


def test_cancelled_event_never_runs():
    c, seen = VirtualClock(), []
    h = c.at(1.0, seen.append, "x")
    c.at(2.0, seen.append, "y")
    c.cancel(h)
    c.run()
    assert seen == ["y"]


def test_run_until_stops_before_later_events_and_resumes():
    c, seen = VirtualClock(), []
    for t in (1.0, 2.0, 3.0):
        c.at(t, seen.append, t)
    c.run(until=2.5)
    assert seen == [1.0, 2.0] and c.now == 2.5 and c.peek() == 3.0
    c.run()
    assert seen == [1.0, 2.0, 3.0]


def test_advance_only_moves_to_a_time_before_everything_queued():
    c = VirtualClock()
    c.at(2.0, lambda: None)
    assert c.advance(1.5) and c.now == 1.5 and c.events_run == 1
    assert not c.advance(2.0) and not c.advance(3.0) and c.now == 1.5  # a tie or later: the queue decides
    assert not c.advance(1.0)  # never backwards
    c.run()
    assert c.advance(10.0) and c.now == 10.0  # nothing queued: any later time
