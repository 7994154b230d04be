"""BatchedObserver (orchestrator/metrics.py): the histogram ends up exactly as with one observe() per value."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from orchestrator.metrics import BatchedObserver

_B = (0.001, 0.002, 0.005, 0.01, 0.1, 1.0)


def _samples(registry) -> tuple[dict, float]:
    """(bucket and count samples, sum): the sum is added in another order, so it may differ in its last bits."""
    out, total = {}, 0.0
    for metric in registry.collect():
        for smp in metric.samples:
            if smp.name.endswith("_sum"):
                total = smp.value
            elif not smp.name.endswith("_created"):
                out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out, total


def _pair():
    ra, rb = CollectorRegistry(), CollectorRegistry()
    return (ra, Histogram("h", "h", ["m"], buckets=_B, registry=ra).labels("x"),
            rb, Histogram("h", "h", ["m"], buckets=_B, registry=rb).labels("x"))


@pytest.mark.parametrize("n, every", [(0, 64), (1, 64), (63, 64), (64, 64), (200, 64), (50, 1)])
def test_same_exposition_as_observe(n, every):
    ra, plain, rb, child = _pair()
    batched = BatchedObserver(child, every=every)
    rng = random.Random(n)
    values = [rng.choice([0.0, 0.001, 0.0010001, 0.002, 0.5, 1.0, 3.0, rng.random()]) for _ in range(n)]
    values += [0.001, 0.002, 1.0, 7.5][: min(4, n)]  # values equal to a bound go in that bucket (le), as observe does
    for v in values:
        plain.observe(v)
        batched.observe(v)
    batched.flush()
    (a, sum_a), (b, sum_b) = _samples(ra), _samples(rb)
    assert a == b and sum_a == pytest.approx(sum_b, rel=1e-12, abs=1e-15)


def test_batches_reach_the_histogram_before_the_end():
    _, _, rb, child = _pair()
    batched = BatchedObserver(child, every=4)
    for _ in range(4):
        batched.observe(0.003)
    assert b'h_bucket{le="0.005",m="x"} 4.0' in generate_latest(rb)  # flushed at the 4th, without flush()


def test_falls_back_to_observe_without_the_child_layout():
    seen = []

    class Child:
        def observe(self, v):
            seen.append(v)

    b = BatchedObserver(Child())
    b.observe(0.5)
    b.flush()
    assert seen == [0.5]


def test_metric_children_are_remembered_and_the_same_series():
    from orchestrator.metrics import FrontendMetrics

    m = FrontendMetrics()
    c = m.child(m.requests, "m", "generate", "ok")
    assert c is m.child(m.requests, "m", "generate", "ok") is m.requests.labels("m", "generate", "ok")
    c.inc()
    m.child(m.ttft, "m").observe(0.1)
    assert m.registry.get_sample_value("kvyard_requests_total", {"model": "m", "endpoint": "generate", "status": "ok"}) == 1
    assert m.registry.get_sample_value("kvyard_time_to_first_token_seconds_count", {"model": "m"}) == 1
    for i in range(5000):  # bounded: a flood of names cannot grow it without end
        m.child(m.isl, f"model-{i}")
    assert len(m._children) <= 4096
