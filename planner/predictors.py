"""Load predictors: one value per tick in (`observe`), a forecast `steps` ticks ahead out (`predict`).

    constant        y(t+k) = y(t)                                      (Dynamo "constant")
    moving_average  y(t+k) = mean of the last `window` points
    holt            Holt's linear trend (double exponential smoothing), hand-written:
                      l_t = a·y_t + (1−a)(l_{t−1} + b_{t−1});  b_t = g(l_t − l_{t−1}) + (1−g)·b_{t−1}
                      y(t+k) = l_t + k·b_t                              (a = 0.5, g = 0.3)
    kalman          local-linear-trend Kalman filter on filterpy's KalmanFilter, as Dynamo's:
                      state [level, trend], F = [[1, 1], [0, 1]], H = [1, 0],
                      Q = diag(q_level, q_trend) = diag(1.0, 0.1), R = 10, after >= 5 points;
                      y(t+k) = level + k·trend. Values are divided by max(|first observation|, 1)/10
                      so the noise settings suit any unit (req/s or tokens).
    peak_trend      an ensemble for the request rate: max(Kalman trend forecast, highest of the last
                      `window` observations). The Kalman filter smooths a step in load over several
                      ticks (its gain is ~0.3), so alone it sizes a burst's first ticks for a fraction
                      of it; the recent peak follows a step at once, the trend leads a ramp. An
                      observation counts as a peak only where it exceeded the trend's one-tick forecast
                      by more than z = 1.28 times its own relative sampling error (`noise` given to
                      observe: 1/√N for a count of N arrivals); otherwise the max of noisy windows would
                      size a steady load for the top of its noise.
All forecasts are floored at 0; `predict` returns None before the first observation. Pure, sync.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol, runtime_checkable

from planner.config import PlannerConfigError

__all__ = ["Predictor", "ConstantPredictor", "MovingAveragePredictor", "HoltPredictor", "KalmanTrendPredictor",
           "PeakTrendPredictor", "make_predictor", "PREDICTORS"]

PREDICTORS = ("constant", "moving_average", "holt", "kalman", "peak_trend")


@runtime_checkable
class Predictor(Protocol):
    def observe(self, value: float, noise: float | None = None) -> None:
        """Called once per tick with the value measured over the last window; `noise`, where known, is that
        measurement's relative sampling error (standard deviation / value)."""
        ...

    def predict(self, steps: float = 1.0) -> float | None:
        """The forecast `steps` ticks ahead (fractions allowed); None until something was observed."""
        ...


class ConstantPredictor:
    def __init__(self) -> None:
        self.last: float | None = None

    def observe(self, value: float, noise: float | None = None) -> None:
        self.last = float(value)

    def predict(self, steps: float = 1.0) -> float | None:
        return self.last


class MovingAveragePredictor:
    def __init__(self, window: int = 6) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def observe(self, value: float, noise: float | None = None) -> None:
        self.values.append(float(value))

    def predict(self, steps: float = 1.0) -> float | None:
        return sum(self.values) / len(self.values) if self.values else None


class HoltPredictor:
    def __init__(self, alpha: float = 0.5, beta: float = 0.3) -> None:
        self.alpha, self.beta = alpha, beta
        self.level: float | None = None
        self.trend = 0.0

    def observe(self, value: float, noise: float | None = None) -> None:
        y = float(value)
        if self.level is None:
            self.level = y
            return
        prev = self.level
        self.level = self.alpha * y + (1 - self.alpha) * (prev + self.trend)
        self.trend = self.beta * (self.level - prev) + (1 - self.beta) * self.trend

    def predict(self, steps: float = 1.0) -> float | None:
        if self.level is None:
            return None
        return max(0.0, self.level + steps * self.trend)


class KalmanTrendPredictor:
    def __init__(self, q_level: float = 1.0, q_trend: float = 0.1, r: float = 10.0, min_points: int = 5) -> None:
        try:
            import numpy as np
            from filterpy.kalman import KalmanFilter
        except ImportError as exc:  # filterpy is in the `planner` extra
            raise PlannerConfigError("the kalman predictor needs filterpy: pip install 'kvyard[planner]'") from exc
        kf = KalmanFilter(dim_x=2, dim_z=1)
        kf.F = np.array([[1.0, 1.0], [0.0, 1.0]])
        kf.H = np.array([[1.0, 0.0]])
        kf.Q = np.diag([q_level, q_trend])
        kf.R = np.array([[r]])
        kf.P = np.eye(2) * 100.0
        self.kf = kf
        self.min_points = min_points
        self.n = 0
        self.scale = 1.0
        self.last: float | None = None

    def observe(self, value: float, noise: float | None = None) -> None:
        y = float(value)
        if self.n == 0:
            self.scale = max(abs(y), 1.0) / 10.0  # observations of ~10 units suit Q and R above
            self.kf.x = self.kf.x * 0.0
            self.kf.x[0, 0] = y / self.scale
        else:
            self.kf.predict()
            self.kf.update(y / self.scale)
        self.n += 1
        self.last = y

    def predict(self, steps: float = 1.0) -> float | None:
        if self.last is None:
            return None
        if self.n < self.min_points:
            return self.last
        level, trend = float(self.kf.x[0, 0]), float(self.kf.x[1, 0])
        return max(0.0, (level + steps * trend) * self.scale)


class PeakTrendPredictor:
    def __init__(self, window: int = 2, trend: Predictor | None = None, z: float = 1.28) -> None:
        self.trend = trend if trend is not None else KalmanTrendPredictor()
        self.z = z
        self.recent: deque[float] = deque(maxlen=max(window, 1))  # observations that stood out of the trend

    def observe(self, value: float, noise: float | None = None) -> None:
        y = float(value)
        before = self.trend.predict(1.0)
        self.trend.observe(y)
        # a step is an observation above what the trend expected by more than its own sampling error: a window's
        # count of N arrivals is off by ~1/√N on its own, and the max of such noise would size for the noise's top
        real = before is None or noise is None or y > before * (1.0 + self.z * noise)
        self.recent.append(y if real else 0.0)

    def predict(self, steps: float = 1.0) -> float | None:
        t = self.trend.predict(steps)
        if t is None:
            return None
        return max(t, max(self.recent))


def make_predictor(name: str, window: int = 6) -> Predictor:
    if name == "constant":
        return ConstantPredictor()
    if name == "moving_average":
        return MovingAveragePredictor(window)
    if name == "holt":
        return HoltPredictor()
    if name == "kalman":
        return KalmanTrendPredictor()
    if name == "peak_trend":
        return PeakTrendPredictor(window)
    raise PlannerConfigError(f"unknown predictor {name!r} ({', '.join(PREDICTORS)})")
