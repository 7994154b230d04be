"""benchmarks/routers_compare.py's pure helpers: /proc parsing, the process-tree CPU sum, cost rows, ratios."""

from __future__ import annotations

import pytest

from benchmarks.loadgen import RequestResult
from benchmarks.routers_compare import (Words, box_cpu, busy_share, cost_row, parse_stat, ratios, summarize,
                                        tree_cpu_seconds)


def stat_line(pid: int, comm: str, ppid: int, utime: int, stime: int, cutime: int = 0, cstime: int = 0) -> str:
    # fields after the comm: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime ...
    return f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 100 0 0 0 {utime} {stime} {cutime} {cstime} 20 0 4 0 1 2 3\n"


def test_parse_stat_handles_spaces_and_parens_in_the_name():
    s = parse_stat(stat_line(42, "tokio (worker) 1", 7, 150, 25, 3, 4))
    assert s == {"pid": 42, "ppid": 7, "utime": 150, "stime": 25, "cutime": 3, "cstime": 4}


def fake_proc(tmp_path, rows):
    for pid, comm, ppid, *ticks in rows:
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "stat").write_text(stat_line(pid, comm, ppid, *ticks))
    (tmp_path / "self").mkdir()  # not a pid: skipped
    return tmp_path


@pytest.mark.parametrize("root, expected", [
    (10, (100 + 50 + 5 + 5) + (20 + 10) + (7 + 3)),   # the router, its child, its grandchild
    (11, (20 + 10) + (7 + 3)),                         # a subtree
    (99, 0),                                           # gone
])
def test_tree_cpu_seconds_sums_descendants_and_reaped_children(tmp_path, root, expected):
    proc = fake_proc(tmp_path, [
        (10, "router", 1, 100, 50, 5, 5),
        (11, "tokenizer pool", 10, 20, 10),
        (12, "helper", 11, 7, 3),
        (20, "other", 1, 1000, 1000),                  # not under the router
    ])
    assert tree_cpu_seconds(root, proc=proc, ticks=100) == pytest.approx(expected / 100)


def test_box_cpu_and_busy_share():
    a = box_cpu("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3\n")
    b = box_cpu("cpu  250 0 100 850 50 0 0 0 0 0\n")
    assert a == (150, 1000) and b == (350, 1250)
    assert busy_share(a, b) == 0.8
    assert busy_share(a, a) is None


@pytest.mark.parametrize("summary, cpu, expected", [
    ({"ok": 100, "output_tokens": 50_000}, 5.0,
     {"cpu_s": 5.0, "cpu_ms_per_request": 50.0, "cpu_s_per_1k_tokens": 0.1, "tokens_per_cpu_s": 10_000.0}),
    ({"ok": 0, "output_tokens": 0}, 0.0,
     {"cpu_s": 0.0, "cpu_ms_per_request": None, "cpu_s_per_1k_tokens": None, "tokens_per_cpu_s": None}),
])
def test_cost_row(summary, cpu, expected):
    assert cost_row(summary, cpu) == expected


def test_ratios_mine_over_each_peer():
    runs = {
        "kvyard-kv": {"ttft_ms": {"p50": 200, "p90": 900}, "output_tok_per_s": 1000, "hit_rate": 0.6,
                      "cpu_ms_per_request": 50, "cpu_s_per_1k_tokens": 0.2},
        "sglang-ca": {"ttft_ms": {"p50": 100, "p90": 1000}, "output_tok_per_s": 1000, "hit_rate": 0.6,
                      "cpu_ms_per_request": 5, "cpu_s_per_1k_tokens": 0.0},
    }
    r = ratios(runs, "kvyard-kv", ["sglang-ca", "vllm-router-rr", "kvyard-kv"])
    assert list(r) == ["sglang-ca"]
    assert r["sglang-ca"] == {"ttft_p50": 2.0, "ttft_p90": 0.9, "output_tok_per_s": 1.0, "hit_rate": 1.0,
                              "cpu_ms_per_request": 10.0, "cpu_s_per_1k_tokens": None}
    assert ratios(runs, "kvyard-rr", ["sglang-ca"]) == {}


def test_summarize_counts_tokens_per_chunk_and_errors():
    res = [RequestResult(ok=True, ttft_s=0.1, gaps_s=[0.01] * 9, completion_tokens=20, prompt_tokens=64),
           RequestResult(ok=True, ttft_s=0.3, gaps_s=[0.02] * 9, completion_tokens=20, prompt_tokens=64),
           RequestResult(ok=False, error="HTTP 503")]
    s = summarize(res, 2.0)
    assert (s["requests"], s["ok"], s["errors"], s["output_tokens"], s["prompt_tokens"]) == (3, 2, 1, 40, 128)
    assert s["tokens_per_chunk"] == 2.0 and s["output_tok_per_s"] == 20.0
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)


def test_words_are_one_token_each():
    from tokenizers import Tokenizer

    from benchmarks.routers_compare import SIM_TOKENIZER

    w = Words()
    tok = Tokenizer.from_file(str(SIM_TOKENIZER / "tokenizer.json"))
    text = "".join(w.block(3)) + "".join(w.block(4)[:100]) + w.text(64, 1)
    assert len(tok.encode(text, add_special_tokens=False).ids) == 512 + 100 + 64
    assert w.block(3) == w.block(3) and w.block(3) != w.block(4)


def test_multi_turn_rows_keep_conversations_not_a_shared_system_block():
    from benchmarks.routers_compare import multi_turn_rows

    rows = [{"hash_ids": [0, 1, 2]},        # turn 1 of conversation A
            {"hash_ids": [0, 5]},           # shares only block 0 (a system prompt): dropped
            {"hash_ids": [0, 1, 2, 3, 4]},  # turn 2 of A
            {"hash_ids": [7, 8]},           # alone
            {"hash_ids": [0, 1, 9]}]        # shares 2 leading blocks with A
    assert multi_turn_rows(rows, 2) == [rows[0], rows[2], rows[4]]
    assert multi_turn_rows(rows, 3) == [rows[0], rows[2]]


def test_aiperf_summary_reads_the_export():
    from benchmarks.routers_compare import aiperf_summary

    export = {"request_count": {"avg": 16.0}, "total_output_tokens": {"avg": 512.0}, "total_isl": {"avg": 1024.0},
              "benchmark_duration": {"avg": 0.8}, "output_token_throughput": {"avg": 640.04},
              "time_to_first_token": {"avg": 37.8, "p50": 39.27, "p90": 51.68, "p99": 52.86},
              "inter_chunk_latency": {"avg": 4.5, "p50": 4.38, "p90": 5.1, "p99": 13.9, "count": 496}}
    s = aiperf_summary(export)
    assert (s["requests"], s["ok"], s["errors"], s["output_tokens"], s["prompt_tokens"]) == (16, 16, 0, 512, 1024)
    assert s["ttft_ms"] == {"p50": 39.27, "p90": 51.68, "p99": 52.86, "mean": 37.8}
    assert s["tokens_per_chunk"] == 1.0 and s["output_tok_per_s"] == 640.0 and s["wall_s"] == 0.8


def test_aiperf_trace_rebases_and_compresses(tmp_path):
    import json

    from benchmarks.routers_compare import aiperf_trace

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in [
        {"timestamp": 1000, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 9000, "input_length": 1100, "output_length": 3, "hash_ids": [1, 2, 3]}]))
    rows = [json.loads(x) for x in aiperf_trace(5, 4.0, 0.25, 0, 2, path=trace).splitlines()]
    assert [(r["timestamp"], r["output_length"]) for r in rows] == [(0, 3), (2000, 1)]
    assert rows[1]["hash_ids"] == [1, 2, 3]


def test_cpu_in_window_interpolates_between_samples():
    from benchmarks.routers_compare import cpu_in_window

    samples = [(0.0, 10.0), (1.0, 10.0), (2.0, 12.0), (3.0, 13.0)]
    assert cpu_in_window(samples, 1.0, 3.0) == pytest.approx(3.0)
    assert cpu_in_window(samples, 1.5, 2.5) == pytest.approx(1.5)
    assert cpu_in_window(samples, -5.0, 9.0) == pytest.approx(3.0)  # clamped to the samples
