"""OpenAI request models: only the fields the frontend acts on are typed; the rest pass through.

Validation failures become 400 invalid_request_error naming the field (never FastAPI's 422).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from orchestrator.errors import BadRequestError

__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage", "StreamOptions", "parse_request"]


MAX_TOKEN_ID = 1 << 31  # token ids are hashed as unsigned 32-bit; no vocabulary comes near this


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=128)  # the engine decides what it supports
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Base):
    prompt: str | list[str] | list[int] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and v and not isinstance(v[0], str):  # token ids: what an engine's vocabulary can hold
            for ids in (v if isinstance(v[0], list) else [v]):
                if not ids:
                    raise ValueError("a token-id prompt must not be empty")
                if min(ids) < 0 or max(ids) >= MAX_TOKEN_ID:
                    raise ValueError(f"token ids must be integers from 0 to {MAX_TOKEN_ID - 1}")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")


class ChatCompletionRequest(_Base):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_request(raw: bytes, kind: type[_Base]) -> tuple[_Base, dict[str, Any]]:
    """Bytes -> (validated model, the original JSON dict to forward). Raises BadRequestError."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequestError("request body must be a JSON object")
    try:
        return kind.model_validate(body), body
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()))
        raise BadRequestError(f"{loc or 'body'}: {err.get('msg', 'invalid value')}", param=loc or None) from exc
