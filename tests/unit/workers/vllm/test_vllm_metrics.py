"""Parsing vLLM 0.32 `/metrics` text into EngineMetrics: golden text, multiple engines, junk."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.types import EngineMetrics
from workers.vllm.metrics import METRIC_NAMES, parse_vllm_metrics

TWO_ENGINES = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 5.0
"""


def test_golden_metrics_text(metrics_text):
    m = parse_vllm_metrics(metrics_text)
    assert m.prefix_cache_queries > 1000  # prompt tokens seen by the prefix cache
    assert m.prefix_cache_hits > 0 and m.prefix_cache_hits <= m.prefix_cache_queries
    assert m.prompt_tokens == m.prefix_cache_queries
    assert m.generation_tokens > 0
    assert m.num_requests_running == 0 and m.num_requests_waiting == 0
    assert 0.0 <= m.kv_cache_usage <= 1.0 and m.num_preemptions == 0


def test_golden_text_has_every_name_we_read(metrics_text):
    for field, names in METRIC_NAMES.items():
        assert names[0] in metrics_text, field


def test_sums_over_engines_and_averages_usage():
    m = parse_vllm_metrics(TWO_ENGINES)
    assert m.num_requests_running == 5 and m.prefix_cache_hits == 15
    assert m.kv_cache_usage == pytest.approx(0.375)


def test_junk_lines_are_skipped_not_fatal(metrics_text):
    garbled = "garbage {{{ line\n" + TWO_ENGINES + 'vllm:num_requests_waiting{engine="0" 7\n\x00\xff\nvllm:num_requests_waiting 4\n'
    m = parse_vllm_metrics(garbled)
    assert m.num_requests_running == 5 and m.num_requests_waiting == 4
    assert parse_vllm_metrics(metrics_text + "\n}}}bad\n").prefix_cache_hits == parse_vllm_metrics(metrics_text).prefix_cache_hits


def test_nan_and_unknown_names_ignored():
    m = parse_vllm_metrics("vllm:num_requests_running NaN\nvllm:something_new 9\nvllm:num_requests_waiting +Inf\n")
    assert m.num_requests_running == 0 and m.num_requests_waiting == 0


def test_older_fallback_names():
    m = parse_vllm_metrics('vllm:gpu_cache_usage_perc{model_name="m"} 0.8\nvllm:gpu_prefix_cache_hits_total 3\n')
    assert m.kv_cache_usage == pytest.approx(0.8) and m.prefix_cache_hits == 3


def test_empty_and_non_text():
    assert parse_vllm_metrics("") .num_requests_running == 0
    assert isinstance(parse_vllm_metrics(None), EngineMetrics)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_never_raises(text):
    m = parse_vllm_metrics(text)
    assert all(math.isfinite(getattr(m, f)) for f in METRIC_NAMES)


def test_labels_holding_braces_and_escaped_quotes_and_timestamps():
    text = ('vllm:num_requests_running{model_name="a}b \\"q\\" {",engine="0"} 3 1700000000000\n'
            'vllm:num_requests_running{engine="1"} 2\n'
            'vllm:num_requests_waiting{engine="0"} 1 \r\n')
    m = parse_vllm_metrics(text)
    assert m.num_requests_running == 5 and m.num_requests_waiting == 1


def test_every_sample_as_prometheus_clients_own_parser_reads_it(metrics_text):
    from prometheus_client.parser import text_string_to_metric_families

    from workers.prom_text import samples_by_name

    want: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name.startswith("vllm:") and math.isfinite(s.value):
                want.setdefault(s.name, []).append(s.value)
    assert want and samples_by_name(metrics_text, "vllm:") == want
