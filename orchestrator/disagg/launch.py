"""Engine flags for a prefill or decode worker, per hand-off protocol (used by `kvyard up` and `kvyard worker`).

    flavor   both roles                                            prefill only
    vllm     --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
             env VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1, VLLM_NIXL_SIDE_CHANNEL_PORT=<free port>
             (each engine its own: the default 5600 would collide between engines of one host)
    sglang   --disaggregation-mode prefill|decode                  --disaggregation-bootstrap-port <free port>
    trtllm   (nothing: the role comes from each request's disaggregated_params)
The sim (backend "sim") also gets `--flavor <flavor>`. What the frontend must know to run the
hand-off (the protocol, the SGLang bootstrap port) is registered in the worker's WorkerInfo.
"""

from __future__ import annotations

import json
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from workers.types import WorkerRole

__all__ = ["PdLaunch", "pd_launch", "pd_registration", "kv_connector_of", "free_port", "role_args"]

NIXL_KV_TRANSFER_CONFIG = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, separators=(",", ":"))


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' source ports (Linux; the usual default elsewhere)."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for an engine that binds it seconds later (after loading its model). Picked outside the
    kernel's ephemeral range: a port from there (what bind(0) gives) can meanwhile become the source port of any
    outgoing connection, a health check's included, and the engine then fails with EADDRINUSE (a clean-clone CI
    run saw vLLM's NIXL side channel do exactly that)."""
    lo, hi = _ephemeral_range()
    below, above = (10000, lo), (hi + 1, 65536)
    start, stop = max(below, above, key=lambda r: r[1] - r[0])
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(start, stop) if stop - start > 1 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:  # every try taken (a crowded host): any free port, as before
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class PdLaunch:
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    pd_protocol: str | None = None
    bootstrap_port: int | None = None


def pd_launch(backend: str, flavor: str, role: WorkerRole, pick_port: Callable[[], int] = free_port,
              kv_buffer_device: str | None = None) -> PdLaunch:
    """Flags, environment and registration fields of one engine in `role` speaking `flavor`'s hand-off.

    `kv_buffer_device="cpu"` is what vLLM's NixlConnector needs on a CPU-only engine (NIXL over UCX
    between host buffers; vLLM's default buffer device is the GPU).
    """
    if flavor not in ("vllm", "sglang", "trtllm"):
        raise ValueError(f"unknown P/D flavor {flavor!r}; known: vllm, sglang, trtllm")
    out = PdLaunch(["--flavor", flavor] if backend == "sim" else [], pd_protocol=flavor if backend == "sim" else None)
    if role == WorkerRole.BOTH:  # aggregated: no hand-off flags (a `both` SGLang worker serves fallbacks)
        return out
    if flavor == "vllm":
        config = NIXL_KV_TRANSFER_CONFIG
        if kv_buffer_device:
            config = json.dumps({**json.loads(config), "kv_buffer_device": kv_buffer_device}, separators=(",", ":"))
        out.extra_args += ["--kv-transfer-config", config]
        out.env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(pick_port())}
    elif flavor == "sglang":
        out.extra_args += ["--disaggregation-mode", role.value]
        if role == WorkerRole.PREFILL:
            out.bootstrap_port = pick_port()
            out.extra_args += ["--disaggregation-bootstrap-port", str(out.bootstrap_port)]
    return out


def role_args(backend: str, role: WorkerRole, engine_args: list[str]) -> list[str]:
    """`kvyard worker`: the flags a `backend` engine needs for `role` that `engine_args` does not already give.
    SGLang: `--disaggregation-mode prefill|decode` (its bootstrap port stays SGLang's default 8998 unless given).
    vLLM's connector has no default worth guessing (the user passes --kv-transfer-config); TRT-LLM's role comes
    with each request, its cache transceiver from the YAML its backend writes."""
    if backend != "sglang" or role == WorkerRole.BOTH or any(a.split("=", 1)[0] == "--disaggregation-mode" for a in engine_args):
        return []
    return ["--disaggregation-mode", role.value]


def pd_registration(backend: str, engine_args: list[str]) -> tuple[str | None, int | None]:
    """(pd_protocol, bootstrap_port) to register for an engine started with `engine_args` (`kvyard worker`)."""
    def value(flag: str) -> str | None:
        for i, a in enumerate(engine_args):
            if a == flag and i + 1 < len(engine_args):
                return engine_args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
        return None

    proto = value("--flavor") if backend == "sim" else None
    port = value("--disaggregation-bootstrap-port")
    if port is None and (proto == "sglang" or backend == "sglang") and value("--disaggregation-mode") == "prefill":
        port = "8998"  # SGLang's default
    return proto, int(port) if port else None


def kv_connector_of(engine_args: list[str]) -> str | None:
    """The vLLM KV connector named by `--kv-transfer-config` in `engine_args` (registered as a worker label)."""
    for i, a in enumerate(engine_args):
        raw = engine_args[i + 1] if a == "--kv-transfer-config" and i + 1 < len(engine_args) else (
            a.split("=", 1)[1] if a.startswith("--kv-transfer-config=") else None)
        if raw is None:
            continue
        try:
            name = json.loads(raw).get("kv_connector")
        except (ValueError, AttributeError):
            return None
        return name if isinstance(name, str) else None
    return None
