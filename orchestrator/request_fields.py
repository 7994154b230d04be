"""What of a client's OpenAI request reaches the engine: an allowlist, and the fields kvyard owns.

    body = RequestFields(cfg).filter(kind, body)

Each top-level field of a /v1/completions or /v1/chat/completions body is one of:

    engine-internal   set only by kvyard, never by a client: always removed (counted, logged once per
                      name). These make a real engine act on another host or on other requests' memory:
                        vLLM      kv_transfer_params (P/D: remote host, port, block ids), ec_transfer_params
                        SGLang    bootstrap_host, bootstrap_port, bootstrap_room (P/D), data_parallel_rank
                        TRT-LLM   disaggregated_params (context/generation hand-off state)
                        identity  request_id, rid (kvyard's X-Request-Id names the request on every engine)
    allowed           the OpenAI API's fields, plus the sampling and formatting extensions the engines
                      document (ALLOWED_COMMON / _COMPLETIONS / _CHAT below), plus the operator's
                      `frontend.security.request_fields.allow` list: forwarded as sent
    anything else     `frontend.security.request_fields.unknown`: "reject" (default, 400 naming the field, as the
                      OpenAI API answers an unrecognized argument) or "drop" (removed, counted)

Left out of the allowlist on purpose (an operator may add them with `allow`): `chat_template`
(a client-supplied Jinja template the engine would run), `prompt_embeds` and `mm_payload`
(client-supplied tensors the engine deserializes), `vllm_xargs`, `mm_processor_kwargs`,
`media_io_kwargs` (engine plug-in arguments), `priority` (the frontend sets it from the API key's class:
orchestrator/resilience/fairshare.py), `lora_path` / `lora_request` (which adapter files an engine loads: the
operator's `lora` list decides). gRPC has its own, narrower
allowlist: the sampling parameters of orchestrator/grpc/llm.py.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from orchestrator.errors import BadRequestError

__all__ = ["RequestFieldsConfig", "RequestFields", "ENGINE_INTERNAL", "ALLOWED_COMMON", "ALLOWED_COMPLETIONS", "ALLOWED_CHAT"]

log = logging.getLogger("kvyard.frontend")

ENGINE_INTERNAL = frozenset({
    "kv_transfer_params", "ec_transfer_params",  # vLLM P/D (NIXL and other connectors), encoder-cache transfer
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "data_parallel_rank",  # SGLang P/D and DP placement
    "disaggregated_params",  # TensorRT-LLM P/D
    "request_id", "rid",  # the request's identity on the engine: kvyard's X-Request-Id
})

ALLOWED_COMMON = frozenset({
    # OpenAI
    "model", "stream", "stream_options", "max_tokens", "n", "temperature", "top_p", "frequency_penalty", "presence_penalty",
    "logit_bias", "logprobs", "seed", "stop", "user", "response_format", "echo",
    # sampling extensions (vLLM, SGLang, TensorRT-LLM)
    "top_k", "min_p", "min_tokens", "repetition_penalty", "length_penalty", "use_beam_search", "best_of", "early_stopping",
    "ignore_eos", "stop_token_ids", "bad_words", "allowed_token_ids", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "truncate_prompt_tokens", "truncation_side", "add_special_tokens",
    "prompt_logprobs", "logprob_token_ids", "return_tokens_as_token_ids", "return_token_ids", "return_token_offsets",
    "cache_salt", "structured_outputs", "regex", "ebnf", "json_schema", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "thinking_token_budget", "stream_interval", "repetition_detection",
    "return_context_logits", "return_generation_logits",
})
ALLOWED_COMPLETIONS = ALLOWED_COMMON | {"prompt", "suffix"}
ALLOWED_CHAT = ALLOWED_COMMON | {
    "messages", "max_completion_tokens", "min_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "functions",
    "function_call", "reasoning_effort", "metadata", "store", "service_tier", "modalities", "audio", "prediction",
    "web_search_options", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents",
    "include_reasoning", "separate_reasoning", "stream_reasoning", "return_prompt_text",
}
_MAX_LOGGED = 64  # distinct dropped names logged (a client can invent unbounded many)


class RequestFieldsConfig(BaseModel):
    """`frontend.security.request_fields`: see orchestrator/request_fields.py."""

    model_config = ConfigDict(extra="forbid")

    allow: list[str] = Field(default_factory=list, description="more top-level fields to forward (e.g. priority)")
    unknown: Literal["reject", "drop"] = Field("reject", description="a field on neither list: 400, or removed")

    @field_validator("allow")
    @classmethod
    def _not_internal(cls, v: list[str]) -> list[str]:
        bad = sorted(set(v) & ENGINE_INTERNAL)
        if bad:
            raise ValueError(f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} set by kvyard itself and cannot be allowed from clients")
        return v


class RequestFields:
    def __init__(self, cfg: RequestFieldsConfig | None = None, on_removed=None) -> None:
        cfg = cfg or RequestFieldsConfig()
        extra = frozenset(cfg.allow)
        self.allowed = {"completions": ALLOWED_COMPLETIONS | extra, "chat": ALLOWED_CHAT | extra}
        self.reject_unknown = cfg.unknown == "reject"
        self.on_removed = on_removed  # (reason) -> None: metrics
        self._logged: set[str] = set()

    def filter(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """The body to forward (the same dict when nothing is removed). Raises BadRequestError (unknown, reject)."""
        allowed = self.allowed[kind]
        extra = [k for k in body if k not in allowed]
        if not extra:
            return body
        removed = []
        for k in extra:
            if k in ENGINE_INTERNAL:
                removed.append((k, "engine_internal"))
            elif self.reject_unknown:
                raise BadRequestError(f"Unrecognized request argument supplied: {k} (kvyard forwards the OpenAI fields and the "
                                      "engines' documented sampling extensions; an operator can allow more with "
                                      "frontend.security.request_fields.allow)", param=k, code="unknown_parameter")
            else:
                removed.append((k, "unknown"))
        for k, reason in removed:
            if self.on_removed is not None:
                self.on_removed(reason)
            if k not in self._logged and len(self._logged) < _MAX_LOGGED:
                self._logged.add(k)
                log.info("removed the %s field %r from a client request (first time; not logged again)", reason.replace("_", "-"), k[:64])
        drop = {k for k, _ in removed}
        return {k: v for k, v in body.items() if k not in drop}
