"""`python -m benchmarks disagg`: the virtual-clock P/D driver prices requests exactly as the sim's own timing
model does, hands KV over without leaking blocks, and the grid's output is well formed."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.disagg import CellSearch, Settings, Slo, main, run_cell
from benchmarks.disagg_sim import Cluster, Conditional, EngineConfig, KvTransfer, Workload, poisson_arrivals
from workers.sim.profiles import load_profile
from workers.sim.timing import TimingModel

PROFILE = load_profile("h200-llama3.1-8b")
TIMING = TimingModel(PROFILE)
ENGINE = EngineConfig(max_model_len=16384)


def _one(mode: str, isl: int, osl: int, n_gpus: int = 2, n_prefill: int = 0, **kw):
    cluster = Cluster(PROFILE, mode, n_gpus, n_prefill, engine=ENGINE, **kw)
    res = cluster.run(Workload([isl], [osl], [0.0]))
    return cluster, res.records[0]


def test_llama8b_kv_bytes_per_token_and_transfer_time() -> None:
    t = KvTransfer()  # 32 layers x 8 KV heads x 128 x (K, V) x BF16
    assert t.bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131072
    fp8 = KvTransfer(dtype_bytes=1, bandwidth_gbs=50.0, latency_ms=0.0)
    assert fp8.seconds(1000) == pytest.approx(1000 * 65536 / 50e9)


def test_aggregated_lone_request_costs_the_profile() -> None:
    isl, osl = 3000, 5
    _, rec = _one("agg", isl, osl)
    assert rec.ttft == pytest.approx(TIMING.ttft_ms(isl) / 1000)  # one prefill step: T(isl)
    for k, gap in enumerate(rec.gaps):  # then one decode step per token at the growing context
        assert gap == pytest.approx(TIMING.decode_ms([isl + k + 1]) / 1000)
    assert rec.tokens == osl and rec.prefill_worker == -1


def test_disaggregated_lone_request_adds_transfer_and_one_decode_step() -> None:
    isl, osl = 3000, 4
    transfer = KvTransfer(bandwidth_gbs=50.0, latency_ms=2.0)
    cluster, rec = _one("disagg", isl, osl, n_gpus=2, n_prefill=1, transfer=transfer)
    prefill = TIMING.ttft_ms(isl) / 1000
    last_prompt_token = TIMING.decode_ms([isl]) / 1000  # the sim's scheduler plans it as a decode step
    assert rec.prefill_done == pytest.approx(prefill)
    assert rec.ttft == pytest.approx(prefill + transfer.seconds(isl) + last_prompt_token)
    assert rec.prefill_worker == 0 and rec.worker == 1 and rec.tokens == osl
    for w in cluster.workers:  # the prefill's held blocks released, the decode's freed: nothing referenced
        assert w.kv.num_free_blocks == w.kv.num_gpu_blocks - 1
        assert not w.sched.held and not w.sched.requests


def test_transfer_time_is_the_sims() -> None:
    from workers.sim.disagg import KvTransferModel, default_kv_bytes_per_token

    sim = KvTransferModel(bytes_per_token=default_kv_bytes_per_token("h200-llama3.1-8b"))
    assert KvTransfer().seconds(3000) == pytest.approx(sim.seconds(3000))


def test_conditional_rule_reasons() -> None:
    wl = Workload([1024] * 6, [8] * 6, [0.01 * i for i in range(6)])
    # unique prompts: eff_isl / prompt = 1 >= 0.7, so IslBounding never fires; the load rule is off here
    res = Cluster(PROFILE, "conditional", 3, 1, engine=ENGINE, conditional=Conditional(queue_threshold=1e9)).run(wl)
    assert res.local_prefills == {"isl": 0, "load": 0}
    assert all(r.prefill_worker == 0 for r in res.records)
    # a ratio threshold above 1 makes every short prompt local
    res = Cluster(PROFILE, "conditional", 3, 1, engine=ENGINE, conditional=Conditional(ratio_threshold=1.01)).run(wl)
    assert res.local_prefills["isl"] == 6 and all(r.prefill_worker == -1 for r in res.records)
    # a burst into one prefill worker: the load rule keeps the overflow on the decode workers
    burst = Workload([4096] * 12, [8] * 12, [0.0] * 12)
    res = Cluster(PROFILE, "conditional", 3, 1, engine=ENGINE, conditional=Conditional(queue_threshold=1.0)).run(burst)
    assert 0 < res.local_prefills["load"] < 12
    assert all(r.finish is not None and r.tokens == 8 for r in res.records)


def test_prefill_routing_sees_the_step_in_flight() -> None:
    # two prompts 1 ms apart on two prefill workers: the second must not queue behind the first
    wl = Workload([8192, 8192], [4, 4], [0.0, 0.001])
    res = Cluster(PROFILE, "disagg", 3, 2, engine=ENGINE).run(wl)
    assert {r.prefill_worker for r in res.records} == {0, 1}
    assert all(r.prefill_done - r.arrival == pytest.approx(TIMING.ttft_ms(8192) / 1000) for r in res.records)


def test_every_mode_finishes_every_request_and_frees_every_block() -> None:
    n = 60
    wl = Workload([2048] * n, [32] * n, poisson_arrivals(n, 40.0, seed=3))
    for mode, npf in (("agg", 0), ("disagg", 2), ("conditional", 2)):
        cluster = Cluster(PROFILE, mode, 4, npf, engine=ENGINE)
        res = cluster.run(wl)
        assert not res.stopped_early
        assert all(r.finish is not None and r.tokens == 32 and r.first_token >= r.arrival for r in res.records)
        assert all(w.kv.num_free_blocks == w.kv.num_gpu_blocks - 1 for w in cluster.workers)


def test_overload_stops_early() -> None:
    n = 400
    wl = Workload([8192] * n, [16] * n, poisson_arrivals(n, 500.0, seed=1))
    res = Cluster(PROFILE, "agg", 1, engine=ENGINE).run(wl, ttft_slo=0.2, tpot_slo=0.01, violation_budget=10)
    assert res.stopped_early
    assert sum(r.finish is not None for r in res.records) < n


def test_more_gpus_never_lower_goodput() -> None:
    st = Settings(min_measured=40, precision=0.1, slo=Slo(itl_ms=10.0))
    totals = []
    for gpus in (1, 2, 4):
        cs = CellSearch(st, 1024, 32, gpus=gpus)
        rate, point = cs.agg()
        assert point is not None and rate > 0
        totals.append(rate * gpus)
    # per-deployment goodput grows with GPUs (within the search's precision)
    assert totals[1] >= totals[0] * (1 - st.precision) and totals[2] >= totals[1] * (1 - st.precision)


def test_cell_invariants() -> None:
    st = Settings(gpus=3, min_measured=40, precision=0.15)
    cell = run_cell(st, 2048, 32)
    assert cell["ttft_target_ms"] == pytest.approx(max(200.0, 2 * TIMING.ttft_ms(2048)), abs=0.1)
    for p in cell["probes"]:
        assert 0.0 <= p["attainment"] <= 1.0
        assert p["goodput_per_gpu"] <= p["throughput_per_gpu"] + 1e-12
        if p["ok"]:
            assert p["ttft_ms"]["p50"] <= p["ttft_ms"]["p90"] and p["itl_ms"]["p50"] <= p["itl_ms"]["p90"]
    for mode in ("disagg", "conditional"):
        m = cell["modes"][mode]
        ok_rates = [p["rate_per_gpu"] for p in cell["probes"] if p["mode"] == mode and p["ok"]]
        assert m["goodput_per_gpu"] == pytest.approx(max(ok_rates), rel=1e-3)  # the best split's best rate
        assert m["split"] == f"{m['at']['n_prefill']}P{m['at']['n_decode']}D"
        assert m["at"]["n_prefill"] + m["at"]["n_decode"] == 3
        assert math.isfinite(cell[f"{mode}_over_agg"]) and cell[f"{mode}_over_agg"] > 0


def test_quick_grid_writes_json_markdown_and_png(tmp_path) -> None:
    rc = main(["--quick", "--gpus", "2", "--isl", "1024", "2048", "--osl", "16", "--min-measured", "30",
               "--out", str(tmp_path), "--name", "t"])
    assert rc == 0
    res = json.loads((tmp_path / "t.json").read_text())
    assert [(c["isl"], c["osl"]) for c in res["cells"]] == [(1024, 16), (2048, 16)]
    assert res["config"]["transfer"]["bytes_per_token"] == 131072
    for c in res["cells"]:
        assert set(c["modes"]) == {"agg", "disagg", "conditional"}
        assert c["modes"]["agg"]["goodput_per_gpu"] > 0
    md = (tmp_path / "t.md").read_text()
    assert "| 1024 | 16 |" in md and "disagg/agg" in md
    assert (tmp_path / "t.png").stat().st_size > 1000
