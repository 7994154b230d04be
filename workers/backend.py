"""The Backend protocol: everything one engine family speaks, in one place.

A backend is used on both sides: the worker process calls `launch_spec` to start the engine server,
and the frontend/router call `parse_metrics` and `decode_kv_frames` on what the engine publishes.
Implementations live one per folder (`workers/vllm`, `workers/sglang`, `workers/trtllm`, `workers/sim`) and are registered by
module path in `workers.registry`, so heavy ones load only when asked for.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from router.kv_events import KvEventBatch
from workers.types import EngineLaunchConfig, EngineMetrics, LaunchSpec

__all__ = ["Backend"]


@runtime_checkable
class Backend(Protocol):
    name: str
    #: path polled until it answers 200 after launch
    health_path: str
    #: path every frontend scrapes (GET) for `parse_metrics`; it must not be drained by a read
    metrics_path: str

    def launch_spec(self, cfg: EngineLaunchConfig) -> LaunchSpec:
        """Called once by the worker before it starts the engine: the argv and environment to run."""
        ...

    def parse_metrics(self, text: str) -> EngineMetrics:
        """Called on each scrape of the engine's metrics endpoint; never raises on unknown lines."""
        ...

    def decode_kv_frames(self, frames: list[bytes]) -> KvEventBatch:
        """Called for each message off the engine's KV-event socket. Raises KvEventDecodeError."""
        ...
