"""Settings of the processes that run engines: `kvyard up` (a local cluster) and `kvyard worker` (one engine).

Both describe their engines with one `EngineSettings`, so a worker started alone and a worker of `kvyard up`
start the same engine from the same defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import shlex

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from orchestrator.config.frontend import FrontendConfig
from workers.types import WorkerRole, parse_cpu_list

__all__ = ["EngineSettings", "ClusterConfig", "LocalPlannerConfig", "RayConfig", "WorkerConfig", "BackendName", "FlavorName"]

_STRICT = ConfigDict(extra="forbid")

BackendName = Literal["sim", "vllm", "sglang", "trtllm"]  # workers/registry.py registers each (a test checks)
FlavorName = Literal["vllm", "sglang", "trtllm"]


class EngineSettings(BaseModel):
    """What every engine of a worker or a local cluster is started with."""

    model_config = _STRICT

    backend: BackendName = Field("sim", description="engine family: sim, vllm, sglang or trtllm")
    model: str = Field("h200-llama3.1-8b", min_length=1, description="sim: profile name; vllm, sglang, trtllm: model "
                                                                     "directory (or id)")
    served_model_name: str = Field("kvyard-sim", min_length=1, description="model name clients ask for")
    block_size: int = Field(16, gt=0, description="KV-cache block size in tokens (vLLM-CPU needs 32)")
    max_model_len: int = Field(8192, gt=0, description="context length")
    engine_args: list[str] = Field(default_factory=list, description="passed to every engine unchanged")
    engine_cmd: list[str] | None = Field(None, description="program that runs each engine instead of the backend's own "
                                                           "(its flags follow), e.g. 'python -m workers.sim --flavor "
                                                           "sglang' (env KVYARD_ENGINE_CMD)")
    tokenizer: str | None = Field(None, description="folder with tokenizer.json for the frontends (default: the model "
                                                    "directory's)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="vllm, sglang: auto picks cuda when nvidia-smi "
                                                                       "is on PATH")
    engine_start_timeout_s: float = Field(600.0, gt=0, description="an engine not healthy by then fails its start")
    engine_cpus: frozenset[int] | None = Field(None, description="Linux CPU list every engine runs on (e.g. 1-7); "
                                                                 "none: any CPU")

    @field_validator("engine_cpus", mode="before")
    @classmethod
    def _cpu_list(cls, v):
        return parse_cpu_list(v) if isinstance(v, str) else v  # ValueError -> a validation error naming the field

    @field_validator("engine_cmd", mode="before")
    @classmethod
    def _command(cls, v):
        return (shlex.split(v) or None) if isinstance(v, str) else v  # a shell-quoted string, as from the flag or env


class LocalPlannerConfig(BaseModel):
    """`kvyard up --planner`: the planner in-process, scaling the local workers (planner/config.py has the rest)."""

    model_config = _STRICT

    enabled: bool = Field(False, description="run the planner in-process")
    interval_s: float = Field(60.0, gt=0, description="seconds between planner ticks")
    advisory: bool = Field(False, description="decide and record, never apply")


class RayConfig(BaseModel):
    """`kvyard up --ray`: the workers as Ray actors (orchestrator/ray_cluster.py)."""

    model_config = _STRICT

    enabled: bool = Field(False, description="run the workers as Ray actors")
    address: str | None = Field(None, description="Ray cluster to join (auto, ray://host:10001, host:6379); "
                                                  "none: a private local one")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the private local Ray cluster")
    actor_cpus: float = Field(0.5, ge=0, description="CPUs each worker actor reserves")
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs each worker actor reserves")
    engine_host: str = Field("127.0.0.1", description="engines bind here (0.0.0.0 on a multi-node cluster)")


class ClusterConfig(EngineSettings):
    """`kvyard up`: a local cluster of engines behind one frontend."""

    frontend: FrontendConfig = Field(default_factory=FrontendConfig, description="the frontend's settings")
    workers: int = Field(2, ge=1, le=128, description="aggregated workers (unused with prefill/decode workers)")
    prefill_workers: int = Field(0, ge=0, le=128, description="> 0 with decode_workers: a disaggregated cluster")
    decode_workers: int = Field(0, ge=0, le=128, description="decode workers of a disaggregated cluster")
    flavor: FlavorName | None = Field(None, description="P/D hand-off protocol; none: the backend's own (sim: vllm); "
                                                        "only the sim plays another engine's")
    base_port: int = Field(8100, gt=0, le=65535, description="first engine port")
    speedup: float = Field(1.0, gt=0, description="sim: divide simulated step times by this")
    log_dir: Path = Field(Path(".kvyard/logs"), description="engine logs")
    planner: LocalPlannerConfig = Field(default_factory=LocalPlannerConfig, description="the in-process planner")
    ray: RayConfig = Field(default_factory=RayConfig, description="workers as Ray actors")

    @model_validator(mode="after")
    def _flavor(self) -> ClusterConfig:
        own = "vllm" if self.backend == "sim" else self.backend
        if self.flavor is None:
            self.flavor = own
        elif self.backend != "sim" and self.flavor != own:
            raise ValueError(f"flavor {self.flavor!r}: a {self.backend} engine speaks its own P/D hand-off ({own}); "
                             "only the sim plays another engine's")
        return self


class WorkerConfig(EngineSettings):
    """`kvyard worker`: one engine, registered in Redis under a lease, drained on SIGTERM."""

    role: WorkerRole = Field(WorkerRole.BOTH, description="both, prefill or decode")
    host: str = Field("127.0.0.1", description="engine bind host")
    advertise_host: str | None = Field(None, description="host frontends use to reach this engine (default: host)")
    port: int = Field(8100, gt=0, le=65535, description="engine HTTP port")
    kv_events_port: int | None = Field(None, gt=0, le=65535, description="engine KV-event port (default: port + 1000; "
                                                                         "the replay socket is the next one)")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis the worker registers in")
    discovery_prefix: str = Field("kvyard", min_length=1, description="Redis key prefix, one per cluster")
    lease_ttl_s: float = Field(6.0, gt=0, description="registration lease, renewed while the engine is healthy")
    drain_timeout_s: float = Field(60.0, ge=0, description="on SIGTERM, longest wait for in-flight requests")
    engine_python: str | None = Field(None, description="interpreter of the engine's own environment")
