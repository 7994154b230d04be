"""TensorRT-LLM's P/D hand-off, context first (serve/openai_disagg_service.py).

    context body    = the client's body with disaggregated_params = {request_type: "context_only",
                      disagg_request_id}, stream = false, stream_options = None
    context answer  = a completion with choices[0].disaggregated_params (opaque state, first
                      generated tokens, ctx_request_id) and prompt_token_ids
    generation body = the client's body with those disaggregated_params, request_type set to
                      "generation_only", and the prompt replaced by the context's prompt token ids
                      (`prompt` on completions, `prompt_token_ids` on chat)
If the context answer already finished (finish_reason other than "length": a stop token or a
one-token request), it is the whole answer and no generation request is sent.
Pure functions; the frontend does the I/O.
"""

from __future__ import annotations

import random

__all__ = ["context_body", "context_finished", "generation_body", "new_disagg_request_id"]

_rng = random.SystemRandom()


def new_disagg_request_id(rng: random.Random | None = None) -> int:
    return (rng or _rng).randint(1, 2**63 - 1)


def context_body(body: dict, disagg_request_id: int) -> dict:
    out = dict(body)
    out["disaggregated_params"] = {"request_type": "context_only", "disagg_request_id": disagg_request_id}
    out["stream"] = False
    out["stream_options"] = None
    return out


def _first_choice(ctx_response: dict) -> dict:
    choices = ctx_response.get("choices") if isinstance(ctx_response, dict) else None
    if not choices or not isinstance(choices[0], dict):
        raise ValueError("the context response has no choices")
    return choices[0]


def context_finished(ctx_response: dict) -> bool:
    """True when the context answer is already complete (its finish_reason is not "length")."""
    return _first_choice(ctx_response).get("finish_reason") != "length"


def generation_body(body: dict, ctx_response: dict, chat: bool) -> dict:
    """The generation-only request; ValueError when the context answer lacks the hand-off."""
    choice = _first_choice(ctx_response)
    params = choice.get("disaggregated_params")
    if not isinstance(params, dict):
        raise ValueError("the context response carries no disaggregated_params")
    ids = ctx_response.get("prompt_token_ids")
    if ids is None:
        ids = choice.get("prompt_token_ids")
    if not isinstance(ids, list):
        raise ValueError("the context response carries no prompt_token_ids")
    out = dict(body)
    out["disaggregated_params"] = {**params, "request_type": "generation_only"}
    if chat:
        out["prompt_token_ids"] = ids
    else:
        out["prompt"] = ids
    return out
