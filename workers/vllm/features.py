"""vLLM's serving features that kvyard drives: runtime LoRA adapters and request priority (vLLM 0.32).

LoRA (`vllm/entrypoints/serve/lora/api_router.py`, `entrypoints/openai/models/serving.py`); the engine must run
with `--enable-lora` (and `--max-loras`, `--max-lora-rank` to fit the adapters) and the environment variable
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, else the routes do not exist (404):

    POST /v1/load_lora_adapter   {"lora_name", "lora_path"}  200 text "Success: ..."; 400 "has already been loaded"
                                                             (kvyard counts it as loaded); 404 no adapter at the path
    POST /v1/unload_lora_adapter {"lora_name"}               200; 404 when not loaded

A request names the adapter in `model` (vLLM serves it under its lora_name); the engine keys the adapter's blocks
with ("lora", name, path) and its KV events carry `lora_name` (workers/vllm/hashing.py).

Priority: `priority` in the request body, an int, lower is served earlier, default 0; the engine must run with
`--scheduling-policy priority`, else any value but 0 is refused.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LOAD_PATH", "UNLOAD_PATH", "RUNTIME_LORA_ENV", "already_loaded", "lora_launch", "lora_request_fields", "load_body",
           "priority_value", "unload_body"]

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
_PRIORITY = {"high": -1, "normal": 0, "low": 1}


def lora_launch(max_loras: int, max_lora_rank: int = 16) -> tuple[list[str], dict[str, str]]:
    """Server flags and environment that let kvyard load adapters at run time (the sim engine takes the same)."""
    return (["--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", str(max_lora_rank)],
            {RUNTIME_LORA_ENV: "True"})


def load_body(name: str, path: str) -> dict[str, Any]:
    return {"lora_name": name, "lora_path": path}


def unload_body(name: str) -> dict[str, Any]:
    return {"lora_name": name}


def already_loaded(status: int, text: str) -> bool:
    """A load refused because the engine already holds the adapter (e.g. loaded before this frontend started)."""
    return status == 400 and "already been loaded" in text


def lora_request_fields(adapter: str, base_model: str) -> dict[str, Any]:
    """Body fields that run a request on the adapter: vLLM serves it under its own name."""
    return {"model": adapter}


def priority_value(priority_class: str) -> int:
    """vLLM's `priority` for a kvyard priority class (lower runs earlier; normal is vLLM's default 0)."""
    return _PRIORITY[priority_class]
