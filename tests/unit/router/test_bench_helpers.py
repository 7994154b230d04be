"""The routing benchmarks' offline hit-rate bounds and the Dynamo comparison's helpers (no cluster started)."""

from __future__ import annotations

import json
import random
from urllib.parse import quote

import pytest

from benchmarks.dynamo_compare import agreement, count_generate_instances, prepare_model_dir, prom_sum, write_standin
from benchmarks.routing import affinity_lru_hits, fleet_bound_hits, oracle_hits

A = [1, 2, 3, 4, 99]  # two full blocks of 2 tokens + one partial token
B = [5, 6, 7, 8, 99]


def wl(*prompts):
    return [{"prompt": list(p)} for p in prompts]


def test_cyclic_reuse_larger_than_the_cache():
    w = wl(A, B, A, B)  # 20 prompt tokens; each repeat could reuse 4 (two blocks) with an infinite cache
    assert oracle_hits(w, 2)["hits"] == 8
    assert oracle_hits(w, 2, capacity_blocks=2)["hits"] == 0  # LRU evicts each block just before its reuse
    # Belady, every block cached on demand: keeps one block of each prompt for its reuse
    bound = fleet_bound_hits(w, 2, capacity_blocks=2)
    assert bound["hits"] == 4 and bound["queries"] == 20
    assert fleet_bound_hits(w, 2, capacity_blocks=4)["hits"] == 8  # fits: the bound is the oracle


def test_vllm_rule_one_prompt_token_is_always_computed():
    w = wl([1, 2, 3, 4], [1, 2, 3, 4])  # second prompt fully cached, but the last block is recomputed
    assert oracle_hits(w, 2)["hits"] == 2
    assert fleet_bound_hits(w, 2, capacity_blocks=8)["hits"] == 2
    assert affinity_lru_hits(w, 2, workers=2, capacity_blocks=8)["hits"] == 2


def test_affinity_lru_partitions_the_cache():
    # two workers of 2 blocks: A and B each stay on their own worker, so both repeats hit fully
    w = wl(A, B, A, B)
    assert affinity_lru_hits(w, 2, workers=2, capacity_blocks=2)["hits"] == 8
    assert affinity_lru_hits(w, 2, workers=1, capacity_blocks=2)["hits"] == 0


@pytest.mark.parametrize("seed", range(5))
def test_bound_is_never_below_the_achievable_references(seed):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(8)] for _ in range(6)]
    w = wl(*(prefixes[rng.randrange(6)][: rng.randrange(2, 9)] + [rng.randrange(1000) for _ in range(3)] for _ in range(60)))
    for workers, cap in ((1, 4), (2, 4), (4, 3)):
        bound = fleet_bound_hits(w, 2, capacity_blocks=workers * cap)["hits"]
        assert bound >= affinity_lru_hits(w, 2, workers, cap)["hits"]
        assert bound >= oracle_hits(w, 2, capacity_blocks=workers * cap)["hits"]
        assert bound <= fleet_bound_hits(w, 2, capacity_blocks=workers * cap, bypass=True)["hits"] <= oracle_hits(w, 2)["hits"]


def test_prom_sum_adds_every_labelled_sample():
    text = (
        "# TYPE dynamo_frontend_cached_tokens histogram\n"
        'dynamo_frontend_cached_tokens_bucket{model="m",le="100"} 1\n'
        'dynamo_frontend_cached_tokens_sum{model="m"} 3968\n'
        'dynamo_frontend_cached_tokens_sum{model="other"} 32\n'
        'dynamo_frontend_cached_tokens_sum_extra{model="m"} 5\n'
        "dynamo_frontend_input_sequence_tokens_sum 6000\n"
    )
    assert prom_sum(text, "dynamo_frontend_cached_tokens_sum") == 4000
    assert prom_sum(text, "dynamo_frontend_input_sequence_tokens_sum") == 6000
    assert prom_sum(text, "absent_metric") == 0


def test_count_generate_instances(tmp_path):
    inst = tmp_path / "v1" / "instances"
    inst.mkdir(parents=True)
    for name in ("dynamo/backend/generate/29c0796e", "dynamo/backend/generate/8c7c69f0",
                 "dynamo/backend/worker_kv_query_source_59173/8c7c69f0"):
        (inst / quote(name, safe="")).write_text("{}")
    (tmp_path / "v1" / "mdc").mkdir()
    (tmp_path / "v1" / "mdc" / quote("dynamo/backend/generate/29c0796e", safe="")).write_text("{}")
    assert count_generate_instances(tmp_path) == 2
    assert count_generate_instances(tmp_path / "missing") == 0


def test_model_dir_carries_the_chat_template_inline(tmp_path):
    src = tmp_path / "tok"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<e>"}))
    (src / "chat_template.jinja").write_text("{{ messages }}")
    out = prepare_model_dir(tmp_path / "model", src)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg == {"eos_token": "<e>", "chat_template": "{{ messages }}"}
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 100256
    assert (out / "tokenizer.json").is_file()


def test_standin_package_imports_anything(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(write_standin(tmp_path)))
    from aisimulate_core.sdk import ForwardPassPerfModelConfig  # noqa: PLC0415 (the stand-in, from tmp_path)

    ForwardPassPerfModelConfig(1, x=2)  # inert


def test_agreement_within_tolerance():
    a = {"ttft_ms": {"p50": 100.0, "p90": 200.0}}
    assert agreement(a, {"ttft_ms": {"p50": 110.0, "p90": 190.0}}, 0.15)["agree"]
    bad = agreement(a, {"ttft_ms": {"p50": 120.0, "p90": 200.0}}, 0.15)
    assert not bad["agree"] and bad["ttft_p50_ratio"] == 1.2
    assert not agreement(a, {"ttft_ms": {"p50": None, "p90": 200.0}}, 0.15)["agree"]


def _run(p90: float, hit: float, errors: int = 0) -> dict:
    return {"ttft_ms": {"p50": p90 / 2, "p90": p90, "p99": p90 * 2, "mean": p90 / 2}, "hit_rate": hit, "errors": errors,
            "error_samples": ["boom"] * errors, "policy": "kv", "generation_tokens_per_worker": [1, 2], "_ttft_all": [p90]}


def test_median_run_takes_each_number_s_median_and_sums_errors():
    from benchmarks.routing import median_run

    one = _run(100, 0.1)
    assert median_run([one]) is one  # a single round is reported as it is
    m = median_run([_run(300, 0.10), _run(100, 0.30, errors=1), _run(200, 0.20)])
    assert m["ttft_ms"] == {"p50": 100, "p90": 200, "p99": 400, "mean": 100}
    assert m["hit_rate"] == 0.2 and m["policy"] == "kv" and m["generation_tokens_per_worker"] == [1, 2]
    assert m["errors"] == 1 and m["error_samples"] == ["boom"]
    assert sorted(m["_ttft_all"]) == [100, 200, 300]
    assert [r["ttft_ms"]["p90"] for r in m["rounds"]] == [300, 100, 200]


def test_paired_ratios_divide_within_each_round():
    from benchmarks.routing import median_run, paired_ratios

    runs = {"kv": median_run([_run(100, 0.1), _run(300, 0.1)]),
            "round-robin": median_run([_run(400, 0.05), _run(600, 0.05)])}
    assert paired_ratios(runs) == [0.25, 0.5]  # not the ratio of the medians (200 / 500 = 0.4)
    single = {"kv": _run(100, 0.1), "round-robin": _run(400, 0.05)}
    assert paired_ratios(single) == [0.25]


def test_routing_disagg_reads_disagg_decisions_by_mode():
    from benchmarks.routing_disagg import disagg_decisions
    text = "\n".join(['# HELP kvyard_disagg_decisions_total x', 'kvyard_disagg_decisions_total{mode="remote",reason="always"} 40.0',
                      'kvyard_disagg_decisions_total{mode="retry",reason="decode_error"} 1.0',
                      'kvyard_disagg_decisions_total{mode="fallback",reason="decode_error"} 2.0',
                      'kvyard_disagg_decisions_total{mode="remote",reason="isl"} 2.0', 'kvyard_disagg_created 1.7e9'])
    assert disagg_decisions(text) == {"remote": 42.0, "retry": 1.0, "fallback": 2.0}


def test_routing_run_list_sweeps_weights_and_pairs():
    from benchmarks.routing import build_parser, run_list
    args = build_parser().parse_args(["--kv-reuse-weight", "16", "--overlap-weights", "4", "--kv-pairs", "16:8,2:1,16:16:32"])
    runs = run_list(args, "kv,round-robin")
    assert runs == [("kv", "kv", {"reuse_weight": 16.0}), ("round-robin", "round-robin", {}),
                    ("kv w=4", "kv", {"reuse_weight": 16.0, "overlap_weight": 4.0}),
                    ("kv w=16 reuse=8", "kv", {"overlap_weight": 16.0, "reuse_weight": 8.0}),
                    ("kv w=2 reuse=1", "kv", {"overlap_weight": 2.0, "reuse_weight": 1.0}),
                    ("kv w=16 reuse=16 req=32", "kv", {"overlap_weight": 16.0, "reuse_weight": 16.0, "request_weight": 32.0})]
    with pytest.raises(SystemExit):
        run_list(build_parser().parse_args(["--kv-pairs", "16"]), "kv")


def test_ttft_floor_prices_each_prompt_at_the_oracles_hits():
    """The floor is each request's own prefill on an idle engine: a repeated prompt costs only its last block's
    worth (the oracle's hits), a fresh one its whole TTFT from the profile."""
    from benchmarks.routing import oracle_hits, ttft_floor
    from workers.sim.profiles import load_profile
    from workers.sim.timing import TimingModel

    rng = random.Random(3)
    fresh = [rng.randrange(5, 30_000) for _ in range(4096)]
    wl = [{"prompt": fresh}, {"prompt": list(fresh)}]
    assert oracle_hits(wl, 16, per_request=True)["per_request"] == [0, 4096 - 16]
    tm = TimingModel(load_profile("h200-llama3.1-8b"), 1.0)
    one = [{"prompt": fresh}]
    assert ttft_floor(one, 16)["p50"] == round(tm.ttft_ms(4096), 1)
    floor = ttft_floor(wl, 16)
    assert floor["p50"] < ttft_floor(one, 16)["p50"] and floor["p99"] <= round(tm.ttft_ms(4096), 1)


def test_engine_phases_and_rate_sweep_summary():
    """The routing bench's queue/prefill split (histogram deltas, wall s -> profile ms) and the rate sweep's verdicts."""
    from benchmarks.routing import engine_phases
    from benchmarks.routing_rate_sweep import render, summarise

    def hist(name, count, total):
        return (f'# TYPE {name} histogram\n{name}_bucket{{le="0.5"}} {count}\n{name}_bucket{{le="+Inf"}} {count}\n{name}_sum {total}\n{name}_count {count}\n')
    before = hist("vllm:request_queue_time_seconds", 2, 0.2) + hist("vllm:request_prefill_time_seconds", 2, 1.0)
    after = hist("vllm:request_queue_time_seconds", 6, 1.0) + hist("vllm:request_prefill_time_seconds", 6, 3.0)
    ph = engine_phases(before, after, speedup=0.25)
    assert ph["queue"]["n"] == 4 and ph["queue"]["mean"] == pytest.approx(50.0)  # 0.8 s / 4 wall -> 0.05 s × 0.25 × 1000
    assert ph["prefill"]["mean"] == pytest.approx(125.0)

    def run(p90s, hit=0.16):
        rounds = [{"ttft_ms": {"p50": 1.0, "p90": x}} for x in p90s]
        return {"ttft_ms": {"p50": 1.0, "p90": sorted(p90s)[len(p90s) // 2]}, "hit_rate": hit, "rounds": rounds,
                "engine_phases_ms": {"queue": {"mean": 10.0}, "prefill": {"mean": 20.0}}}

    def res(kv, rr, ratios):
        return {"trace": {"params": {"rate_profile": 21.2}, "runs": {"kv": run(kv), "round-robin": run(rr, 0.05)},
                          "kv_over_rr_p90": sorted(ratios)[len(ratios) // 2], "kv_over_rr_p90_rounds": ratios,
                          "kv_hit_over_bound_pct": 96.4, "ttft_floor_ms": {"p90": 572.0}}}
    met = summarise(7.0, res([800, 850], [2800, 3000], [0.286, 0.283]), unloaded_p90=578.0)
    low = summarise(5.0, res([700], [1450], [0.483]), unloaded_p90=578.0)
    assert met["round_robin"]["p90_over_unloaded"] == pytest.approx(3000 / 578, abs=0.01) and met["kv"]["round_p90s"] == [800, 850]
    text = render({"params": {"repeats": 2, "num_gpu_blocks": 59064, "requests": 500, "out": "x", "unloaded_requests": 40},
                   "when": "now", "machine": "m", "command": "c", "unloaded_ms": {"p50": 147.0, "p90": 578.0}, "rates": [low, met]})
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| 5 ") or line.startswith("| 7 ")}
    assert "missed (rr < 3× unloaded)" in rows["5"] and "| met |" in rows["7"]
