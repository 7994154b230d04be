"""Backends by name. Each is registered as a module path and imported on first use."""

from __future__ import annotations

import importlib

from workers.backend import Backend

__all__ = ["get_backend", "backend_names", "create_backend", "DEVICE_BACKENDS"]

DEVICE_BACKENDS = ("vllm", "sglang")  # backends whose command line depends on the device (cpu | cuda)

_BACKENDS: dict[str, str] = {
    "vllm": "workers.vllm.backend:VllmBackend",
    "sglang": "workers.sglang.backend:SglangBackend",
    "trtllm": "workers.trtllm.backend:TrtllmBackend",
    "sim": "workers.sim.backend:SimBackend",
}

_cache: dict[str, Backend] = {}


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str) -> Backend:
    if name not in _BACKENDS:
        raise KeyError(f"unknown backend {name!r}; known: {', '.join(backend_names())}")
    if name not in _cache:
        module, _, attr = _BACKENDS[name].partition(":")
        _cache[name] = getattr(importlib.import_module(module), attr)()
    return _cache[name]


def create_backend(name: str, device: str | None = None) -> Backend:
    """A backend for launching engines: `device` (cpu | cuda) for vllm and sglang, else the shared instance."""
    if device is None or name not in DEVICE_BACKENDS:
        return get_backend(name)
    module, _, attr = _BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), attr)(device=device)
