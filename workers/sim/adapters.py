"""LoRA adapters in the sim engine, as vLLM 0.32 (and SGLang under `--flavor sglang`) serve them.

    --enable-lora [--max-loras N] [--lora-modules name=path ...]     adapters the engine may serve
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (read by the entry point)   adds the runtime routes:
      vLLM    POST /v1/load_lora_adapter {"lora_name", "lora_path"}   200 "Success: LoRA adapter 'x' added successfully."
              POST /v1/unload_lora_adapter {"lora_name"}              200 "Success: LoRA adapter 'x' removed successfully."
      SGLang  POST /load_lora_adapter, /unload_lora_adapter           the same bodies, JSON {"success": true, ...}

Errors as vLLM's (`_check_load_lora_adapter_request`, `LoRAAdapterNotFoundError`): 400 without both fields or for a
base model's name, 400 "has already been loaded" for a loaded name (unless load_inplace), 404 "No adapter found"
for a path without adapter_config.json, 404 "cannot be found" when unloading an unknown name. A request whose
`model` is a loaded adapter runs on it (SGLang: `lora_path` names it); its blocks are keyed by the adapter
(workers/sim/hashing.py), so the cache never shares them with the base model or another adapter, and its
events carry `lora_name` and vLLM's extra keys. `/v1/models` lists adapters with root = path, parent = the base
model, as vLLM does. Adapters cost no extra compute in the sim's timing (a LoRA matmul is small next to the base).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

__all__ = ["SimLoras", "load_lora_adapter", "unload_lora_adapter"]


class SimLoras:
    """The adapters an engine serves: name -> path, in load order."""

    def __init__(self, enabled: bool, modules: dict[str, str] | None = None) -> None:
        self.enabled = enabled
        self.loaded: OrderedDict[str, str] = OrderedDict(modules or {})

    def get(self, name: str | None) -> tuple[str, str] | None:
        if name is None or name not in self.loaded:
            return None
        return name, self.loaded[name]


def _error(message: str, err_type: str, code: int, flavor: str) -> JSONResponse:
    if flavor == "sglang":
        return JSONResponse({"object": "error", "message": message, "type": err_type, "param": None, "code": code}, status_code=code)
    return JSONResponse({"error": {"message": message, "type": err_type, "param": None, "code": code}}, status_code=code)


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError:
        body = None
    return body if isinstance(body, dict) else {}


def _ok(message: str, flavor: str) -> Response:
    if flavor == "sglang":
        return JSONResponse({"success": True, "error_message": "", "loaded_adapters": None, "message": message})
    return Response(message, status_code=200)


async def load_lora_adapter(request: Request) -> Response:
    st = request.app.state.sim
    loras: SimLoras = st.loras
    flavor = st.cfg.flavor
    body = await _body(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not loras.enabled:
        return _error("LoRA is not enabled. Use --enable-lora to enable LoRA.", "BadRequestError", 400, flavor)
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        return _error("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400, flavor)
    if name in st.cfg.served_model_names:
        return _error(f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput", 400, flavor)
    if name in loras.loaded and not body.get("load_inplace"):
        return _error(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                      "set 'load_inplace' to True.", "InvalidUserInput", 400, flavor)
    if not (Path(path) / "adapter_config.json").is_file():
        return _error(f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError", 404, flavor)
    loras.loaded[name] = path
    return _ok(f"Success: LoRA adapter '{name}' added successfully.", flavor)


async def unload_lora_adapter(request: Request) -> Response:
    st = request.app.state.sim
    loras: SimLoras = st.loras
    flavor = st.cfg.flavor
    name = (await _body(request)).get("lora_name")
    if not isinstance(name, str) or not name:
        return _error("'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400, flavor)
    if name not in loras.loaded:
        return _error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404, flavor)
    del loras.loaded[name]
    return _ok(f"Success: LoRA adapter '{name}' removed successfully.", flavor)
