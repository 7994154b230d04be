"""Load mode thresholds: any worker over -> up, all under -> down, else stay."""

from __future__ import annotations

import pytest

from planner.config import LoadThresholds
from planner.load import load_step
from planner.types import PoolObservation
from planner.telemetry.schema import PoolKey

from .conftest import stats

TH = LoadThresholds()


@pytest.mark.parametrize("role,queue,kv,ttft,itl,delta,words", [
    ("prefill", [0, 3], [], 100, None, 1, "waiting requests"),      # any worker queued
    ("prefill", [0, 0], [], 900, None, 1, "TTFT p90"),              # latency over target (500)
    ("prefill", [0, 0.05], [], 100, None, -1, "quiet"),             # all quiet, fast
    ("prefill", [0, 0.5], [], 100, None, 0, "within"),              # between thresholds
    ("decode", [0, 0], [0.2, 0.95], None, 10, 1, "KV cache"),       # any KV over 0.9
    ("decode", [0, 0], [0.2, 0.5], None, 30, 1, "ITL p90"),         # ITL over 25
    ("decode", [0, 0], [0.2, 0.5], None, 10, -1, "quiet"),
    ("decode", [0, 0], [0.2, 0.7], None, 10, 0, "within"),          # one worker above kv_down
    ("decode", [0, 0], [0.2, 0.5], None, 22, 0, "within"),          # ITL above 0.8·target
    ("prefill", [], [], 100, None, 0, "within"),                    # no worker samples: never down
    ("both", [0, 0], [0.95], 100, 10, 1, "KV cache"),
])
def test_load_step(role, queue, kv, ttft, itl, delta, words):
    pool = PoolKey("m", role)
    po = PoolObservation(pool, replicas=2, stats=stats(pool, ttft_p90=ttft, itl_p90=itl), data_age_s=1.0,
                         worker_queue=queue, worker_kv=kv)
    got, why = load_step(po, 500.0, 25.0, TH)
    assert got == delta and words in why
