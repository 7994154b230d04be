"""Conditional disaggregation: the decision table (orchestrator/disagg/decision.py), Dynamo's rule as baseline."""

from __future__ import annotations

import pytest

from orchestrator.config import DisaggConfig
from orchestrator.disagg import decide

BASE = DisaggConfig()  # max_local_isl 2048, ratio 0.7, queue_threshold 4.0 x 8192, max_local_prefill_length 0


@pytest.mark.parametrize("cfg, prompt, cached, active, remote, reason", [
    # Dynamo IslBounding: local only when the uncached part is short AND most of the prompt is on decode
    (BASE, 1000, 0, 0, True, "long_prompt"),  # short but nothing cached: eff/prompt = 1.0
    (BASE, 1000, 400, 0, False, "cached_on_decode"),  # eff 600 < 2048 and 0.6 < 0.7
    (BASE, 1000, 200, 0, True, "long_prompt"),  # eff 800 but 0.8 of the prompt is uncached
    (BASE, 4000, 3000, 0, False, "cached_on_decode"),  # eff 1000 < 2048, 0.25 < 0.7
    (BASE, 10000, 7000, 0, True, "long_prompt"),  # eff 3000 >= 2048
    (BASE, 3000, 900, 0, True, "long_prompt"),  # eff 2100 >= 2048
    (BASE, 2000, 601, 0, False, "cached_on_decode"),  # eff 1399, ratio 0.6995
    (BASE, 2000, 600, 0, True, "long_prompt"),  # ratio exactly 0.7 is not below 0.7
    # Dynamo PrefillLoad: active tokens on the chosen prefill worker > 4.0 x 8192
    (BASE, 10000, 0, 32768, True, "long_prompt"),  # equal to the threshold: not above
    (BASE, 10000, 0, 32769, False, "prefill_saturated"),
    # legacy max_local_prefill_length (off by default)
    (DisaggConfig(max_local_prefill_length=1000), 900, 0, 0, False, "short_prompt"),
    (DisaggConfig(max_local_prefill_length=1000), 1001, 0, 0, True, "long_prompt"),
    (DisaggConfig(max_local_prefill_length=1000), 1200, 300, 0, False, "short_prompt"),  # eff 900, ratio 0.75
    # always: the rule is off
    (DisaggConfig(mode="always"), 4000, 3000, 10**6, True, "always"),
    # no tokenizer: the length is unknown, prefill remotely unless the prefill pool is saturated
    (BASE, 0, 0, 0, True, "untokenized"),
    (BASE, 0, 0, 40000, False, "prefill_saturated"),
])
def test_decision_table(cfg, prompt, cached, active, remote, reason):
    d = decide(cfg, prompt, cached, active)
    assert (d.remote, d.reason) == (remote, reason)
    assert d.eff_isl == max(0, prompt - cached)


def test_thresholds_are_config():
    cfg = DisaggConfig(max_local_isl=100, max_local_ratio=0.5, queue_threshold=1.0, max_num_batched_tokens=10)
    assert decide(cfg, 1000, 950, 0).remote is False  # eff 50 < 100, 0.05 < 0.5
    assert decide(cfg, 1000, 850, 0).remote is True  # eff 150 >= 100
    assert decide(cfg, 1000, 0, 11).reason == "prefill_saturated"
