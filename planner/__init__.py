"""SLA planner: scales prefill/decode/aggregated pools against TTFT, ITL and tokens/s targets.

    config.py       PlannerConfig (mode sla|load|hybrid, predictor, intervals, guardrails)
    types.py        PoolObservation, Observation, Demand, PoolDecision, Decision
    perf_model.py   PerfModel from an NPZ profile (prefill TTFT(ISL), decode ITL(KV usage, context))
    sla.py          replicas for a predicted demand (Dynamo's formulas + an M/M/n TTFT tail)
    load.py         ±1 from queue / KV usage / latency thresholds
    predictors.py   constant, moving average, Holt, Kalman local-linear-trend (filterpy)
    core.py         PlannerCore.on_tick(now, observation) -> Decision  (zero I/O)
    connectors/     PlannerConnector Protocol: virtual, local, kubernetes, ray
    loop.py         observe (telemetry store) -> decide (core) -> act (connector) -> record
"""

from planner.config import LoadThresholds, PlannerConfig, PlannerConfigError
from planner.core import PlannerCore
from planner.perf_model import PerfModel, load_perf_model
from planner.predictors import (
    ConstantPredictor,
    HoltPredictor,
    KalmanTrendPredictor,
    MovingAveragePredictor,
    Predictor,
    make_predictor,
)
from planner.types import Decision, Demand, Observation, PoolDecision, PoolObservation

__all__ = [
    "PlannerConfig", "LoadThresholds", "PlannerConfigError", "PlannerCore", "PerfModel", "load_perf_model",
    "Predictor", "ConstantPredictor", "MovingAveragePredictor", "HoltPredictor", "KalmanTrendPredictor", "make_predictor",
    "Decision", "Demand", "Observation", "PoolDecision", "PoolObservation",
]
