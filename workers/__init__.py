"""Engine adapters (vLLM, SGLang, TensorRT-LLM), the simulated engine, the worker process, and the registry
contract a worker publishes (workers.types, workers.discovery). Backends decode their engine's KV events into
the router's event model (router/kv_events.py)."""

from workers.types import EngineLaunchConfig, EngineMetrics, LaunchSpec, WorkerInfo, WorkerRole, WorkerState

__all__ = ["EngineLaunchConfig", "EngineMetrics", "LaunchSpec", "WorkerInfo", "WorkerRole", "WorkerState"]
