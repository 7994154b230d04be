"""Conditional disaggregation: run this request's prefill on a prefill worker, or locally on decode?

Pure and synchronous. Dynamo's rule (its router's `conditional_disagg.rs`) is the baseline:

    eff_isl = prompt_tokens - decode_overlap_blocks · block_size      (the part decode lacks)
    local  when  eff_isl < max_local_isl (2048)  and  eff_isl / prompt_tokens < max_local_ratio (0.7)
                 ("cached_on_decode": most of the prompt is already on the decode worker)
    local  when  active prefill tokens on the chosen prefill worker
                     > queue_threshold (4.0) × max_num_batched_tokens (8192)
                 ("prefill_saturated": waiting for the prefill pool would cost more than it saves)
    local  when  eff_isl <= max_local_prefill_length (0: off)
                 ("short_prompt": Dynamo v0 / TRT-LLM's max_local_prefill_length rule)
    remote otherwise ("long_prompt"; "untokenized" when the frontend has no tokenizer for the model)

Mode "always" sends every request to a prefill worker (reason "always"); the frontend applies
the decision only when the model has prefill workers at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.config import DisaggConfig

__all__ = ["DisaggConfig", "DisaggDecision", "decide"]


@dataclass(frozen=True, slots=True)
class DisaggDecision:
    remote: bool  # True: prefill on a prefill worker; False: the decode worker prefills itself
    reason: str
    eff_isl: int


def decide(cfg: DisaggConfig, prompt_tokens: int, decode_cached_tokens: int, prefill_active_tokens: int) -> DisaggDecision:
    """Where to prefill one request (formula in the module docstring)."""
    eff = max(0, prompt_tokens - decode_cached_tokens)
    if cfg.mode == "always":
        return DisaggDecision(True, "always", eff)
    if prompt_tokens > 0 and eff < cfg.max_local_isl and eff / prompt_tokens < cfg.max_local_ratio:
        return DisaggDecision(False, "cached_on_decode", eff)
    if prefill_active_tokens > cfg.queue_threshold * cfg.max_num_batched_tokens:
        return DisaggDecision(False, "prefill_saturated", eff)
    if prompt_tokens == 0:  # no tokenizer for the model yet: the prompt's length is unknown
        return DisaggDecision(True, "untokenized", eff)
    if eff <= cfg.max_local_prefill_length:
        return DisaggDecision(False, "short_prompt", eff)
    return DisaggDecision(True, "long_prompt", eff)
