"""Reliability on the request path: circuit breakers and jittered retries (breaker), bounded
admission per model (admission), mid-stream migration of broken streams (migration), and hung engines taken
out of routing with their requests failed over (liveness)."""

from orchestrator.resilience.admission import AdmissionController, Ticket, worker_saturated
from orchestrator.resilience.breaker import BreakerBoard, BreakerState, backoff_s
from orchestrator.resilience.liveness import HungWorkers

__all__ = ["AdmissionController", "Ticket", "worker_saturated", "BreakerBoard", "BreakerState", "backoff_s", "HungWorkers"]
