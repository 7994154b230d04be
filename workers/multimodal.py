"""Multimodal chat prompts, the one way the frontend (to route) and the sim engine (to serve) read them.

Content parts of a chat message, as the OpenAI API and vLLM take them:

    {"type": "text", "text": ...}
    {"type": "image_url", "image_url": {"url": "https://... | data:image/png;base64,..."}, "uuid": optional}
    {"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav"}, "uuid": optional}
    {"type": "audio_url", "audio_url": {"url": ...}, "uuid": optional}

anything else is refused (`ContentError`, a 400 naming the part). Each image or audio item gets an identifier:
its `uuid` when the client gave one, else `sha256` of its source (the URL or the base64 data, with the modality
and format), so the same image always has the same identifier. The frontend writes that identifier into the
part's `uuid` before forwarding: vLLM then uses it as the item's hash identifier (vLLM 0.32: a client uuid is
the identifier when the model has no extra processor kwargs), so the engine's block keys and the router's agree.

Placeholders. A message's content is its parts in order, joined by "\n" (text parts as vLLM joins them), each
item standing for a run of `MmTokenSpec` placeholder tokens (`tokens_per_image` of `image_token_id`, audio
alike). The chat template is rendered with a private-use sentinel per item; the rendered text is split at the
sentinels, each piece tokenized, and the runs spliced in: the prompt's token ids and its items
(identifier, offset, length) in order. The run length of a real vision model depends on the model and the
image size; set the spec to the model's values (docs/features.md says what matches when they differ).

`router.mm_hashing.block_mm_keys` is vLLM's per-block walk over the items (`_gen_mm_extra_hash_keys`, vllm/v1/core/kv_cache_utils.py):
for each full block, (identifier, item offset - block start) of every item overlapping it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from router.mm_hashing import MmItem  # one item as the router hashes it

__all__ = ["ContentError", "MmItem", "MmTokenSpec", "MM_PART_TYPES", "flatten_messages",
           "has_mm_parts", "item_identifier", "tokenize_mm_chat"]

MM_PART_TYPES = {"image_url": "image", "input_audio": "audio", "audio_url": "audio"}
TEXT_TYPES = ("text",)
_SENTINEL = re.compile("\ue000(\\d+)\ue001")



class ContentError(ValueError):
    """A content part that cannot be served; `param` names where it is (messages.I.content.J)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class MmTokenSpec:
    """How many placeholder tokens an image / audio clip stands for, and which token id fills the run."""

    tokens_per_image: int = 256
    image_token_id: int = 100255
    tokens_per_audio: int = 128
    audio_token_id: int = 100254

    def run(self, modality: str) -> tuple[int, int]:
        """(token id, count) of one item's placeholder run."""
        if modality == "image":
            return self.image_token_id, self.tokens_per_image
        return self.audio_token_id, self.tokens_per_audio


def _source(part: dict[str, Any], ptype: str, where: str) -> str:
    """The part's source as one canonical string (what identifies the item's content)."""
    inner = part.get(ptype)
    if ptype == "input_audio":
        if not isinstance(inner, dict) or not isinstance(inner.get("data"), str) or not inner["data"]:
            raise ContentError("an input_audio part needs input_audio.data (base64)", f"{where}.input_audio.data")
        return json.dumps(["input_audio", inner.get("format") or "", inner["data"]])
    url = inner.get("url") if isinstance(inner, dict) else inner if isinstance(inner, str) else None
    if not isinstance(url, str) or not url:
        raise ContentError(f"an {ptype} part needs {ptype}.url", f"{where}.{ptype}.url")
    return json.dumps([ptype, url])


def item_identifier(part: dict[str, Any], where: str = "content") -> tuple[str, str]:
    """(modality, identifier) of one image or audio part: its `uuid`, else sha256 of its source."""
    ptype = part.get("type")
    modality = MM_PART_TYPES.get(ptype)  # type: ignore[arg-type]
    if modality is None:
        raise ContentError(f"content part type {ptype!r} is not an image or audio part", f"{where}.type")
    source = _source(part, ptype, where)  # validated even when a uuid is given
    uuid = part.get("uuid")
    if uuid is not None:
        if not isinstance(uuid, str) or not uuid or len(uuid) > 256:
            raise ContentError("uuid must be a non-empty string of at most 256 characters", f"{where}.uuid")
        return modality, uuid
    return modality, hashlib.sha256(source.encode()).hexdigest()


def has_mm_parts(messages: Sequence[dict[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") in MM_PART_TYPES
                                                        for p in m["content"]) for m in messages)


def flatten_messages(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """Messages with string content (text parts joined by "\n", each image/audio part a sentinel), and the items'
    (modality, identifier) in order. Raises ContentError for a part that is neither text, image nor audio."""
    out: list[dict[str, Any]] = []
    items: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append({**m, "content": "" if content is None else content})
            continue
        pieces = []
        for j, part in enumerate(content):
            where = f"messages.{i}.content.{j}"
            ptype = part.get("type") if isinstance(part, dict) else None
            if ptype in TEXT_TYPES:
                text = part.get("text")
                if not isinstance(text, str):
                    raise ContentError("a text part needs a string `text`", f"{where}.text")
                pieces.append(text)
            elif ptype in MM_PART_TYPES:
                items.append(item_identifier(part, where))
                pieces.append(f"\ue000{len(items) - 1}\ue001")
            else:
                supported = ", ".join(("text", *MM_PART_TYPES))
                raise ContentError(f"content part type {ptype!r} is not supported; supported: {supported}", f"{where}.type")
        out.append({**m, "content": "\n".join(pieces)})
    return out, items


def tokenize_mm_chat(rendered: str, items: Sequence[tuple[str, str]], encode: Callable[[str], list[int]],
                     spec: MmTokenSpec) -> tuple[list[int], list[MmItem]]:
    """A chat prompt rendered from `flatten_messages` -> (token ids with placeholder runs, items in order).

    `encode(text)` tokenizes one piece without adding special tokens. A sentinel the template dropped leaves its
    item out (its data is not in the prompt)."""
    ids: list[int] = []
    out: list[MmItem] = []
    pos = 0
    for match in _SENTINEL.finditer(rendered):
        if match.start() > pos:
            ids.extend(encode(rendered[pos : match.start()]))
        k = int(match.group(1))
        if k < len(items):
            modality, ident = items[k]
            token, count = spec.run(modality)
            out.append((ident, len(ids), count))
            ids.extend([token] * count)
        pos = match.end()
    if pos < len(rendered):
        ids.extend(encode(rendered[pos:]))
    return ids, out
