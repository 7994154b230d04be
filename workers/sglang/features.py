"""SGLang's serving features that kvyard drives: runtime LoRA adapters and request priority.

LoRA (SGLang `srt/entrypoints/http_server.py`; the server needs `--enable-lora` and `--max-loras-per-batch`,
`--max-lora-rank`, `--lora-target-modules` to fit the adapters):

    POST /load_lora_adapter   {"lora_name", "lora_path"}   {"success": true|false, "error_message": ...}
    POST /unload_lora_adapter {"lora_name"}

A request runs on an adapter when its `lora_path` field names a loaded adapter; `model` stays the base model.
Priority: `priority` in the request body, an int, larger is served earlier by default; the server needs
`--enable-priority-scheduling`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LOAD_PATH", "UNLOAD_PATH", "already_loaded", "lora_request_fields", "load_body", "priority_value", "unload_body"]

LOAD_PATH = "/load_lora_adapter"
UNLOAD_PATH = "/unload_lora_adapter"
_PRIORITY = {"high": 1, "normal": 0, "low": -1}


def load_body(name: str, path: str) -> dict[str, Any]:
    return {"lora_name": name, "lora_path": path}


def unload_body(name: str) -> dict[str, Any]:
    return {"lora_name": name}


def already_loaded(status: int, text: str) -> bool:
    return status == 400 and "already" in text and "loaded" in text


def lora_request_fields(adapter: str, base_model: str) -> dict[str, Any]:
    return {"model": base_model, "lora_path": adapter}


def priority_value(priority_class: str) -> int:
    return _PRIORITY[priority_class]
