"""Engine adapters (vLLM, SGLang, TensorRT-LLM), the simulated engine, and the worker process."""

from workers.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, KvEventDecodeError
from workers.types import EngineLaunchConfig, EngineMetrics, LaunchSpec, WorkerInfo, WorkerRole, WorkerState

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineLaunchConfig",
    "EngineMetrics",
    "KvEventBatch",
    "KvEventDecodeError",
    "LaunchSpec",
    "WorkerInfo",
    "WorkerRole",
    "WorkerState",
]
