"""Predictors on known series: constant, moving average, Holt and the Kalman trend filter."""

from __future__ import annotations

import math

import pytest

from planner.config import PlannerConfigError
from planner.predictors import make_predictor

LINEAR = [10 + 2 * t for t in range(30)]  # next value 70, three ahead 74
FLAT = [5.0] * 30
STEP = [10.0] * 15 + [30.0] * 15


@pytest.mark.parametrize("name,series,steps,expected,tol", [
    ("constant", LINEAR, 1, 68, 0.0),           # repeats the last value
    ("constant", FLAT, 3, 5, 0.0),
    ("moving_average", LINEAR, 1, 63, 0.0),     # mean of the last 6: 58..68
    ("moving_average", FLAT, 1, 5, 0.0),
    ("holt", LINEAR, 1, 70, 0.05),              # follows the trend
    ("holt", LINEAR, 3, 74, 0.1),
    ("holt", FLAT, 1, 5, 1e-6),
    ("kalman", LINEAR, 1, 70, 0.2),
    ("kalman", LINEAR, 3, 74, 0.3),
    ("kalman", FLAT, 1, 5, 1e-6),
    ("holt", STEP, 1, 30, 0.5),                 # settles on the new level
    ("kalman", STEP, 1, 30, 1.5),
])
def test_known_series(name, series, steps, expected, tol):
    p = make_predictor(name)
    assert p.predict() is None
    for v in series:
        p.observe(v)
    assert p.predict(steps) == pytest.approx(expected, abs=tol)


@pytest.mark.parametrize("name", ["holt", "kalman"])
def test_trend_predictors_anticipate_a_rise(name):
    """A daily-curve morning: from the trough upwards; 3 ticks ahead, a trend model beats 'constant'."""
    curve = [100 - 50 * math.cos(2 * math.pi * t / 48) for t in range(15)]
    p, c = make_predictor(name), make_predictor("constant")
    for v in curve[:12]:
        p.observe(v)
        c.observe(v)
    assert abs(p.predict(3) - curve[14]) < abs(c.predict(3) - curve[14]) / 2


def test_forecasts_never_negative():
    for name in ("holt", "kalman"):
        p = make_predictor(name)
        for v in [50, 40, 30, 20, 10, 5, 2, 1]:
            p.observe(v)
        assert p.predict(20) == 0.0


def test_kalman_waits_for_five_points():
    p = make_predictor("kalman")
    for v in (1, 2, 3, 4):
        p.observe(v)
    assert p.predict(5) == 4  # the last value until warm


def test_unknown_predictor():
    with pytest.raises(PlannerConfigError):
        make_predictor("arima")


def test_peak_trend_is_the_max_of_the_trend_and_the_recent_peak():
    from planner.predictors import PeakTrendPredictor

    p = make_predictor("peak_trend", 2)
    assert isinstance(p, PeakTrendPredictor) and p.predict() is None
    for v in STEP[:20]:  # 10 ... then a step to 30 five points ago: the peak follows at once
        p.observe(v)
    k = make_predictor("kalman")
    for v in STEP[:16]:
        k.observe(v)
    assert k.predict(1) < 25  # the Kalman filter alone is still far below the step
    q = make_predictor("peak_trend", 2)
    for v in STEP[:16]:
        q.observe(v)
    assert q.predict(1) == pytest.approx(30)
    for v in LINEAR:  # on a ramp the trend leads the peak
        p.observe(v)
    assert p.predict(3) > max(LINEAR)
    spikes = make_predictor("peak_trend", 2)
    for v in [10, 10, 10, 10, 10, 50, 10, 10]:  # a single spike leaves the peak after `window` ticks
        spikes.observe(v)
    assert spikes.predict(1) < 20
