"""The planner's Prometheus gauges (a private registry unless one is passed in, e.g. the frontend's)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from planner.types import Decision

__all__ = ["PlannerMetrics"]


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        labels = ["model", "role"]
        self.current = Gauge("kvyard_planner_current_replicas", "Replicas the connector reported at the tick", labels, registry=r)
        self.desired = Gauge("kvyard_planner_desired_replicas", "Replicas the planner decided", labels, registry=r)
        self.applied = Gauge("kvyard_planner_applied_replicas", "Replicas the connector applied", labels, registry=r)
        self.sla = Gauge("kvyard_planner_sla_replicas", "Replicas the SLA model asked for, before guardrails", labels, registry=r)
        self.rate = Gauge("kvyard_planner_predicted_request_rate", "Predicted requests per second", labels, registry=r)
        self.isl = Gauge("kvyard_planner_predicted_isl", "Predicted mean input tokens", labels, registry=r)
        self.osl = Gauge("kvyard_planner_predicted_osl", "Predicted mean output tokens", labels, registry=r)
        self.ticks = Counter("kvyard_planner_ticks", "Planner ticks by outcome", ["outcome"], registry=r)
        self.telemetry_ok = Gauge("kvyard_planner_telemetry_ok", "1 if the telemetry store answered at the last tick", registry=r)
        self.advisory = Gauge("kvyard_planner_advisory", "1 in advisory (dry-run) mode", registry=r)

    def observe(self, d: Decision, applied: dict | None, telemetry_ok: bool, outcome: str) -> None:
        self.ticks.labels(outcome).inc()
        self.telemetry_ok.set(1 if telemetry_ok else 0)
        self.advisory.set(1 if d.advisory else 0)
        for p in d.pools:
            lab = (p.pool.model, p.pool.role)
            self.current.labels(*lab).set(p.current)
            self.desired.labels(*lab).set(p.desired)
            if applied is not None and p.pool in applied:
                self.applied.labels(*lab).set(applied[p.pool])
            elif not p.changed:
                self.applied.labels(*lab).set(p.current)
            if p.sla_replicas is not None:
                self.sla.labels(*lab).set(p.sla_replicas)
            if p.demand is not None:
                self.rate.labels(*lab).set(p.demand.request_rate)
                self.isl.labels(*lab).set(p.demand.isl)
                self.osl.labels(*lab).set(p.demand.osl)
