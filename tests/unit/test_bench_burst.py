"""benchmarks/burst_headers.py: the per-router summary of a burst (percentiles, groups by send order)."""

from benchmarks.burst_headers import summary


def test_summary_groups_by_send_order_and_skips_failures():
    rows = [{"sent_s": i / 1000, "headers_s": 0.1 + i / 100, "ttft_s": 1.0 + i / 100, "ok": True} for i in range(16)]
    rows.append({"sent_s": 0.02, "headers_s": 0.5, "ttft_s": None, "ok": False})
    rows.sort(key=lambda r: r["sent_s"])
    s = summary(rows, parts=4)
    assert (s["ok"], s["requests"], s["send_spread_ms"]) == (16, 17, 20.0)
    assert s["headers_p50_by_send_order_ms"] == [115, 155, 195, 235]  # medians of 4 rows each, in send order
    assert s["ttft_p50_by_send_order_ms"] == [1015, 1055, 1095, 1135]
    assert s["headers_ms"]["p10"] == 110.0 and s["headers_ms"]["p90"] == 240.0
