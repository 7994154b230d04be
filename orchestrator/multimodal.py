"""Multimodal chat prompts in the frontend: placeholder runs and item identifiers for routing.

    ids, items = chat_prompt(tokenizer, messages, spec)

Chat messages go through workers/multimodal.py, the code the sim engine serves them with: content parts in order
joined by "\n", each image or audio part a run of placeholder tokens (`MultimodalConfig`: how many, which id), its
identifier the part's `uuid` or the sha256 of its source. `items` = (identifier, offset, length) per image/audio
part; the router mixes them into the block hashes (router/mm_hashing.py), so two requests with the same image
share the prefix through it and different images never do. `stamp_uuids` writes each identifier into its part's
`uuid` before the request goes to a vLLM engine, which then keys its cache blocks by that identifier too, so the
engine's KV events and the router's hashes agree. A part that is neither text, image nor audio is a 400.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.errors import BadRequestError
from workers.multimodal import MM_PART_TYPES, ContentError, MmItem, MmTokenSpec, flatten_messages, item_identifier, tokenize_mm_chat

__all__ = ["MultimodalConfig", "chat_prompt", "stamp_uuids"]

_DEFAULT = MmTokenSpec()


class MultimodalConfig(BaseModel):
    """Image and audio parts of chat messages (YAML `frontend.multimodal`)."""

    model_config = ConfigDict(extra="forbid")

    tokens_per_image: int = Field(_DEFAULT.tokens_per_image, ge=1, description="placeholder tokens one image stands for in the prompt")
    image_token_id: int = Field(_DEFAULT.image_token_id, ge=0, description="token id of the image placeholder run")
    tokens_per_audio: int = Field(_DEFAULT.tokens_per_audio, ge=1, description="placeholder tokens one audio clip stands for")
    audio_token_id: int = Field(_DEFAULT.audio_token_id, ge=0, description="token id of the audio placeholder run")
    stamp_uuids: bool = Field(True, description="write each item's identifier into its part's `uuid` for vLLM engines")

    def spec(self) -> MmTokenSpec:
        return MmTokenSpec(self.tokens_per_image, self.image_token_id, self.tokens_per_audio, self.audio_token_id)


def chat_prompt(tok, messages: list[dict[str, Any]], spec: MmTokenSpec) -> tuple[list[int], list[MmItem]]:
    """Token ids of the chat prompt (template applied) and its multimodal items; BadRequestError for a bad part."""
    try:
        flat, items = flatten_messages(messages)
    except ContentError as exc:
        raise BadRequestError(str(exc), param=exc.param) from exc
    rendered = tok.render_chat(flat)
    if not items:
        return tok.encode(rendered, add_special_tokens=False), []
    return tokenize_mm_chat(rendered, items, lambda piece: tok.encode(piece, add_special_tokens=False), spec)


def stamp_uuids(body: dict[str, Any]) -> dict[str, Any]:
    """A copy of a chat body whose image/audio parts all carry their identifier as `uuid` (the body is unchanged
    when it has none). Call after `chat_prompt` validated the parts."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages):
        return body
    out = []
    changed = False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in MM_PART_TYPES and part.get("uuid") is None:
                part = {**part, "uuid": item_identifier(part)[1]}
                changed = True
            parts.append(part)
        out.append({**m, "content": parts})
    return {**body, "messages": out} if changed else body
