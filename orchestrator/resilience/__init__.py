"""Reliability on the request path: circuit breakers and jittered retries (breaker), bounded
admission per model (admission), and mid-stream migration of broken streams (migration)."""

from orchestrator.resilience.admission import AdmissionController, Ticket, worker_saturated
from orchestrator.resilience.breaker import BreakerBoard, BreakerState, backoff_s

__all__ = ["AdmissionController", "Ticket", "worker_saturated", "BreakerBoard", "BreakerState", "backoff_s"]
