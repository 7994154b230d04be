"""Request models and validation for the sim's OpenAI routes, with vLLM 0.32's error JSON.

Errors look exactly like vLLM's: `{"error": {"message", "type", "param", "code"}}` with
- `BadRequestError` / 400 for request checks, message suffixed `(parameter=P, value=V)` like
  `VLLMValidationError.__str__`;
- `Bad Request` / 400 for schema errors: "N validation error(s):\n  {pydantic error dict}" with
  `loc` joined as `body.<field>` (vLLM's RequestValidationError handler);
- `NotFoundError` / 404 for an unknown model.
Unknown request fields are accepted and ignored (vLLM logs and ignores them too).
Sim limitations (400): `prompt_logprobs`, `logprobs` with `echo`, `n > 1` on a P/D hand-off (the logprob values
themselves are made up: workers/sim/logprobs.py).
`best_of` is accepted and ignored, as vLLM 0.32 (V1) does.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from workers.sim.logprobs import MAX_LOGPROBS

__all__ = [
    "ApiError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "StreamOptions",
    "bad_request",
    "logprobs_k",
    "parse_body",
    "validate_sampling",
]


MAX_N_SEQUENCES = 16384  # vLLM 0.32's VLLM_MAX_N_SEQUENCES default


class ApiError(Exception):
    """One OpenAI-style error response."""

    def __init__(self, message: str, err_type: str = "BadRequestError", code: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.err_type, self.code, self.param = message, err_type, code, param

    def body(self, flavor: str = "vllm") -> dict[str, Any]:
        """vLLM 0.32 nests the error; SGLang and TRT-LLM answer their flat `ErrorResponse`
        {"object": "error", "message", "type", "param", "code"}."""
        if flavor in ("sglang", "trtllm"):
            return {"object": "error", "message": self.message, "type": self.err_type, "param": self.param, "code": self.code}
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, value: Any = None) -> ApiError:
    extras = []
    if param is not None:
        extras.append(f"parameter={param}")
    if value is not None:
        extras.append(f"value={value}")
    return ApiError(f"{message} ({', '.join(extras)})" if extras else message, param=param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    n: int = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default_factory=list)
    stop_token_ids: list[int] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    logprobs: Any = None
    prompt_logprobs: int | None = None
    request_id: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    return_token_ids: bool | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class CompletionRequest(_Common):
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    max_tokens: int | None = 16
    echo: bool | None = False


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]]
    prompt_token_ids: list[int] | None = None  # TRT-LLM generation_only chat requests carry the ctx prompt ids
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


def _summarize(value: Any) -> Any:
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:200] + "...[truncated]"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    return str(value)


def _schema_error(errors: list[dict[str, Any]]) -> ApiError:
    count = len(errors)
    label = "error" if count == 1 else "errors"
    lines = []
    for err in errors[:10]:
        err = dict(err)
        if "input" in err:
            err["input"] = _summarize(err["input"])
        err["loc"] = ".".join(str(p) for p in err.get("loc", ()))
        lines.append(f"  {err}\n")
    message = f"{count} validation {label}:\n" + "".join(lines)
    if count > 10:
        message += f"  ...and {count - 10} more {label}\n"
    param = errors[0].get("loc") if errors else None
    return ApiError(message.rstrip(), err_type="Bad Request", param=".".join(str(p) for p in param) if param else None)


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """JSON body -> request model, or raise ApiError shaped like vLLM's validation errors."""
    try:
        data = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        pos = getattr(exc, "pos", 0)
        msg = getattr(exc, "msg", str(exc))
        raise _schema_error(
            [{"type": "json_invalid", "loc": ("body", pos), "msg": "JSON decode error", "input": {}, "ctx": {"error": msg}}]
        ) from exc
    if not isinstance(data, dict):
        raise _schema_error([{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary or object to extract fields from", "input": data}])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise _schema_error(errors) from exc


def logprobs_k(req: _Common) -> int | None:
    """Alternatives per token the request asks for: completions' `logprobs: k`, chat's `logprobs: true` with
    `top_logprobs: k` (0 when absent); None: no logprobs."""
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs is not True:
            return None
        top = (req.model_extra or {}).get("top_logprobs")
        return int(top) if isinstance(top, int) and not isinstance(top, bool) and top >= 0 else 0
    lp = req.logprobs
    return lp if isinstance(lp, int) and not isinstance(lp, bool) and lp >= 0 else None


def validate_sampling(req: _Common) -> None:
    """vLLM's request-level and SamplingParams checks that do not depend on the prompt."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    if req.n < 1:
        raise bad_request(f"n must be at least 1, got {req.n}.")
    if req.n > MAX_N_SEQUENCES:
        raise bad_request(f"n must be at most {MAX_N_SEQUENCES}, got {req.n}. To increase this limit, set the "
                          "VLLM_MAX_N_SEQUENCES environment variable.")
    if req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs are not supported by the kvyard sim engine.", "prompt_logprobs", req.prompt_logprobs)
    k = logprobs_k(req)
    if k is not None and k > MAX_LOGPROBS:
        raise bad_request(f"Requested sample logprobs of {k}, which is greater than max allowed: {MAX_LOGPROBS}", "logprobs", k)
    if k is not None and getattr(req, "echo", False):
        raise bad_request("logprobs with echo are not supported by the kvyard sim engine.", "logprobs", k)
    if req.temperature is not None:
        if req.temperature < 0:
            raise bad_request(f"temperature must be non-negative, got {req.temperature}.", "temperature", req.temperature)
        if req.temperature > 2:
            raise bad_request(f"temperature must be in [0, 2], got {req.temperature}.", "temperature", req.temperature)
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {req.top_p}.", "top_p", req.top_p)
    if req.min_tokens < 0:
        raise bad_request(f"min_tokens must be greater than or equal to 0, got {req.min_tokens}.")
