"""Dynamo's mocker step timing in kvyard's sim: its formulas on a small hand-made perf-data NPZ."""

from __future__ import annotations

import numpy as np
import pytest

from workers.sim.kv_manager import KvBlockManager
from workers.sim.mocker_timing import MockerTiming, is_mocker_npz
from workers.sim.scheduler import StepPlan


@pytest.fixture
def npz(tmp_path):
    p = tmp_path / "perf_data.npz"
    kv = np.array([0.0, 1000.0, 2000.0])
    ctx = np.array([100.0, 200.0])
    itl = np.array([[2.0, 4.0], [3.0, 5.0], [5.0, 9.0]])  # rows: active KV tokens, columns: context length
    np.savez(p, prefill_isl=np.array([100.0, 200.0, 400.0]), prefill_ttft_ms=np.array([10.0, 20.0, 30.0]),
             decode_active_kv_tokens=kv, decode_context_length=ctx, decode_itl=itl)
    return p


def test_recognises_mocker_files(npz, tmp_path):
    assert is_mocker_npz(npz)
    other = tmp_path / "x.npz"
    np.savez(other, prefill_isl=np.array([1.0]))
    assert not is_mocker_npz(other) and not is_mocker_npz(tmp_path / "missing.npz")
    with pytest.raises(ValueError, match="missing"):
        MockerTiming(other)


def test_prefill_is_the_curve_at_the_batch_new_tokens_extrapolated(npz):
    m = MockerTiming(npz)
    assert m.prefill_ms(0, 0, 0) == 0.0
    assert m.prefill_ms(1, 150, 0) == pytest.approx(15.0)
    assert m.prefill_ms(2, 300, 100) == pytest.approx(20.0)  # 2 x (150 - 50) = 200 new tokens
    assert m.prefill_ms(1, 800, 0) == pytest.approx(50.0)  # past the end: the last segment's slope
    assert m.prefill_ms(1, 20, 0) == pytest.approx(2.0)  # before the start, extrapolated down
    assert m.prefill_ms(1, 100, 100) == 0.0  # nothing new


def test_decode_is_bilinear_with_a_one_ms_floor(npz):
    m = MockerTiming(npz)
    assert m.decode_ms(500.0, 150.0) == pytest.approx((2.0 + 3.0 + 4.0 + 5.0) / 4)
    assert m.decode_ms(2000.0, 200.0) == pytest.approx(9.0)
    assert m.decode_ms(3000.0, 200.0) == pytest.approx(13.0)  # extrapolated from the edge cell
    assert m.decode_ms(0.0, 0.0) == 1.0  # 2.0 - (4 - 2) = 0 -> floored at 1 ms


def test_a_step_prices_new_prefill_tokens_and_every_sampling_request(npz):
    m = MockerTiming(npz, speedup=2.0)
    kv = KvBlockManager(101, 10)
    kv._free.popleft(), kv._free.popleft()  # two blocks in use: 20 active KV tokens
    plan = StepPlan(prefill_chunks=[(0, 150), (100, 50)], decode_contexts=[120, 180], prefills_done=1, prefills_done_tokens=150)
    plan.scheduled = [object()]
    pre = m.prefill_ms(2, 150 + 150, 100)
    dec = m.decode_ms(20.0, (120 + 180 + 150) // 3)
    assert m.plan_ms(plan, kv) == pytest.approx((pre + dec) / 2.0)
