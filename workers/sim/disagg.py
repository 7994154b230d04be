"""Prefill/decode disaggregation in the sim: the three engines' hand-off protocols on one transfer model.

Roles (who prefills, who decodes) and wire fields are each engine's own (workers/{vllm,sglang,trtllm}/handoff.py):

- **vLLM (NixlConnector)**, enabled by `--kv-transfer-config '{"kv_connector":"NixlConnector",...}'`.
  A request whose `kv_transfer_params.do_remote_decode` is true is a *prefill*: it runs, its blocks
  stay held after it finishes (finish reason length/stop only, like `request_finished` in
  `nixl/pull_scheduler.py`), and the non-streaming response carries the top-level
  `kv_transfer_params` {do_remote_prefill: true, do_remote_decode: false, remote_block_ids: [[ids]]
  (one list per KV-cache group), remote_engine_id, remote_request_id, remote_host, remote_port,
  tp_size, dcp_size, pp_size, remote_num_tokens, remote_blocks_expiry_time (null on the P node, as
  in 0.32), transfer_mode: "pull", remote_prefill_cached_tokens}. A request whose
  `do_remote_prefill` is true is a *decode*: it needs do_remote_prefill, remote_engine_id,
  remote_request_id, remote_host, remote_port, tp_size and remote_block_ids.
  Held blocks are freed when the decode has read them, when their lease (`kv_lease_duration` in
  `kv_connector_extra_config`, 30 s) runs out (decode-side heartbeats renew it every lease/6 while
  the decode request waits), or when a decode that never read them ends (vLLM's abort-notify and
  serving-layer rejection paths). A failed load (missing fields, unknown / expired request, P
  unreachable) follows `kv_load_failure_policy`: "fail" (default) ends the request with
  finish_reason "error" (HTTP 500 "Internal server error", like vLLM's GenerationError);
  "recompute" prefills locally.
- **SGLang**: `--disaggregation-mode prefill|decode`, `--disaggregation-bootstrap-port`. The same
  body (with `bootstrap_host`, `bootstrap_port`, `bootstrap_room`) goes to both servers at once.
  The prefill server runs the prompt (max_new_tokens forced to 1) and keeps the KV under the room;
  the decode server waits up to `--kv-transfer-timeout` for that room, pulls it, then decodes.
- **TensorRT-LLM**: `disaggregated_params.request_type` = "context_only" (prefill, one token,
  response `choices[0].disaggregated_params` + top-level `prompt_token_ids`) or "generation_only"
  (decode; `encoded_opaque_state` names where the context KV lives).

The transfer itself goes over a real side channel: every prefill-capable sim listens on a ZMQ
ROUTER (vLLM: `VLLM_NIXL_SIDE_CHANNEL_HOST:PORT`, default localhost:5600; SGLang: the bootstrap
port; TRT-LLM: `--kv-side-channel-port`, ephemeral by default). Messages are msgpack maps
`{"op": "pull"|"done"|"abort"|"heartbeat", ...}` answered with `{"ok": bool, ...}`; this protocol is
the sim's own (the engines move bytes with NIXL/Mooncake/UCX), only the HTTP-visible fields are
the engines'. A decode request is admitted by the scheduler like any other (its blocks are
allocated up front and it counts as waiting, reason "deferred", like vLLM's
WAITING_FOR_REMOTE_KVS), then pulls: it waits `KvTransferModel.seconds(tokens)` and tells the
prefill side it is done (which frees the held blocks), then its blocks are cached (BlockStored)
and only the last prompt token is computed, as a decode step: TTFT = queue + transfer + one step.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import random
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio
from pydantic import BaseModel, ConfigDict

__all__ = [
    "DEFAULT_KV_BYTES_PER_TOKEN",
    "FLAVORS",
    "DisaggRuntime",
    "Handoff",
    "KvSideChannel",
    "KvTransferConfig",
    "KvTransferModel",
    "RemoteSource",
    "VLLM_DECODE_REQUIRED",
    "decode_opaque_state",
    "default_kv_bytes_per_token",
    "encode_opaque_state",
    "side_channel_call",
    "sglang_bootstrap",
    "vllm_missing_fields",
    "vllm_role",
]

log = logging.getLogger(__name__)

FLAVORS = ("vllm", "sglang", "trtllm")
#: fields a vLLM decode request's kv_transfer_params must carry (nixl/base_scheduler.py, metadata.py)
VLLM_DECODE_REQUIRED = ("do_remote_prefill", "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                        "tp_size", "remote_block_ids")
CALL_TIMEOUT_S = 5.0  # a side-channel answer that takes longer than this (beyond any wait asked for) = unreachable
OPAQUE_MAGIC = "kvyard-sim-ctx/1"

# --------------------------------------------------------------------------------------------------
# KV size and transfer time
# --------------------------------------------------------------------------------------------------

#: profile name -> (layers, KV heads, head dim) of its model
_GEOMETRY: dict[str, tuple[int, int, int]] = {
    "h200-llama3.1-8b": (32, 8, 128),  # Llama-3.1-8B: 32 layers, GQA 8 KV heads of dim 128
    "h100-llama3.3-70b-tp2": (80, 8, 128),  # Llama-3.3-70B: 80 layers, 8 KV heads of dim 128
    "h100-llama3.3-70b-tp4": (80, 8, 128),
    "h100-llama3.3-70b-tp8": (80, 8, 128),
}
KV_DTYPE_BYTES = 2  # cache_dtype "auto" = the model's bf16 activations (the sim reports cache_dtype=auto)
DEFAULT_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * KV_DTYPE_BYTES  # Llama-3.1-8B: 131072 B = 128 KiB per token


def default_kv_bytes_per_token(profile: str) -> int:
    """KV bytes one token occupies, summed over all layers (and all TP ranks):

        layers x KV heads x head dim x 2 (K and V) x dtype bytes

    Llama-3.1-8B (h200-llama3.1-8b): 32 x 8 x 128 x 2 x 2 = 131072 B (128 KiB).
    Llama-3.3-70B (h100-llama3.3-70b-*): 80 x 8 x 128 x 2 x 2 = 327680 B (320 KiB).
    A profile directory of unknown model gets the 8B figure (pass --kv-bytes-per-token)."""
    layers, heads, dim = _GEOMETRY.get(profile, (32, 8, 128))
    return layers * heads * dim * 2 * KV_DTYPE_BYTES


@dataclass(frozen=True)
class KvTransferModel:
    """seconds(tokens) = (latency + tokens x bytes_per_token / bandwidth) / speedup (bandwidth in GB/s, 1e9)."""

    bandwidth_gbps: float = 25.0
    bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    latency_ms: float = 1.0
    speedup: float = 1.0

    def seconds(self, num_tokens: int) -> float:
        wire = max(0, num_tokens) * self.bytes_per_token / (self.bandwidth_gbps * 1e9)
        return (self.latency_ms / 1000.0 + wire) / self.speedup


# --------------------------------------------------------------------------------------------------
# Per-engine request fields (pure)
# --------------------------------------------------------------------------------------------------


class KvTransferConfig(BaseModel):
    """vLLM's `KVTransferConfig` (vllm/config/kv_transfer.py, 0.32): the fields the sim reads."""

    model_config = ConfigDict(extra="ignore")

    kv_connector: str | None = None
    engine_id: str | None = None
    kv_buffer_device: str = "cuda"
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] | None = None
    kv_port: int = 14579
    kv_connector_extra_config: dict[str, Any] = {}
    kv_load_failure_policy: Literal["recompute", "fail"] = "fail"
    enable_permute_local_kv: bool = False

    def model_post_init(self, _ctx: object) -> None:
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())

    @property
    def is_nixl(self) -> bool:
        return self.kv_connector == "NixlConnector"

    @property
    def lease_s(self) -> float:
        return float(self.kv_connector_extra_config.get("kv_lease_duration", 30))


def vllm_role(params: dict[str, Any] | None) -> Literal["prefill", "decode"] | None:
    """P node: `do_remote_decode` (request_finished's is_p_node); D node: `do_remote_prefill`."""
    if not params:
        return None
    if params.get("do_remote_decode"):
        return "prefill"
    if params.get("do_remote_prefill"):
        return "decode"
    return None


def vllm_missing_fields(params: dict[str, Any]) -> list[str]:
    """Required decode fields that are absent or null (remote_block_ids must also be non-empty)."""
    missing = [k for k in VLLM_DECODE_REQUIRED if params.get(k) is None]
    if "remote_block_ids" not in missing and not params["remote_block_ids"]:
        missing.append("remote_block_ids")
    return missing


def _scalar(v: Any) -> Any:
    """SGLang's PD fields may be per-batch lists; the sim serves one prompt per request."""
    if isinstance(v, list):
        return v[0] if len(v) == 1 else None
    return v


def sglang_bootstrap(extra: dict[str, Any]) -> tuple[str, int, int] | list[str]:
    """(bootstrap_host, bootstrap_port, bootstrap_room), or the names of the missing/invalid fields."""
    host, port, room = (_scalar(extra.get(k)) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"))
    bad = []
    if not isinstance(host, str) or not host:
        bad.append("bootstrap_host")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        bad.append("bootstrap_port")
    if isinstance(room, bool) or not isinstance(room, int) or room < 0:
        bad.append("bootstrap_room")
    return bad or (host, port, room)


def encode_opaque_state(state: dict[str, Any]) -> str:
    """TRT-LLM's `encoded_opaque_state` is base64 of engine-private bytes; the sim's bytes are JSON."""
    return base64.b64encode(json.dumps({"magic": OPAQUE_MAGIC, **state}, separators=(",", ":")).encode()).decode()


def decode_opaque_state(s: Any) -> dict[str, Any]:
    """Inverse of encode_opaque_state; ValueError when it is not one of the sim's states."""
    if not isinstance(s, str) or not s:
        raise ValueError("encoded_opaque_state is missing")
    try:
        state = json.loads(base64.b64decode(s, validate=True))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"encoded_opaque_state is not valid base64 JSON: {exc}") from exc
    if not isinstance(state, dict) or state.get("magic") != OPAQUE_MAGIC:
        raise ValueError("encoded_opaque_state was not produced by a context server")
    host, port, key = state.get("host"), state.get("port"), state.get("ctx_request_id")
    if not isinstance(host, str) or not isinstance(port, int) or not isinstance(key, int):
        raise ValueError("encoded_opaque_state lacks host, port or ctx_request_id")
    return state


# --------------------------------------------------------------------------------------------------
# What the HTTP handler and the engine need per request
# --------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class RemoteSource:
    """Where a decode request's prompt KV lives and how its load went."""

    host: str
    port: int
    key: str
    wait_s: float = 0.0  # how long the prefill side may take to produce it (SGLang: both start at once)
    recompute_on_failure: bool = False
    state: Literal["pending", "pulling", "done", "failed"] = "pending"
    error: str | None = None
    loaded_tokens: int = 0


@dataclass
class Handoff:
    role: Literal["prefill", "decode"]
    key: str = ""  # prefill: the key the KV is held under (vLLM request id, SGLang room, TRT-LLM ctx id)
    max_tokens: int | None = None  # forced generation length (SGLang prefill, TRT-LLM context: 1)
    remote: RemoteSource | None = None
    ctx_request_id: int | None = None
    disagg_request_id: Any = None
    remote_cached_tokens: int | None = None  # vLLM decode: the prefill's prefix-cache hit, reported as cached


# --------------------------------------------------------------------------------------------------
# The side channel
# --------------------------------------------------------------------------------------------------

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


async def side_channel_call(ctx: zmq.asyncio.Context, host: str, port: int, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One request/answer with a prefill sim's side channel; {"ok": False, "error": ...} when it does not answer."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        await sock.send_multipart((b"", _enc.encode(msg)))
        if not await sock.poll(timeout=int(timeout_s * 1000), flags=zmq.POLLIN):
            return {"ok": False, "error": f"KV side channel {host}:{port} did not answer within {timeout_s:.1f}s"}
        frames = await sock.recv_multipart()
        reply = _dec.decode(frames[-1])
        return reply if isinstance(reply, dict) else {"ok": False, "error": "malformed side-channel answer"}
    except (zmq.ZMQError, msgspec.DecodeError) as exc:
        return {"ok": False, "error": f"KV side channel {host}:{port}: {exc}"}
    finally:
        sock.close(linger=0)


@dataclass(eq=False)
class _Held:
    """KV kept on the prefill side under `key` (created by whichever side comes first, for SGLang)."""

    key: str
    req_key: str | None = None  # engine request id; None until the prefill request arrives
    num_tokens: int = 0
    deadline: float = float("inf")
    held: bool = False  # blocks are held in the engine (the prefill finished)
    reading: bool = False
    abandoned: bool = False  # the decode gave up before the prefill finished: free as soon as it does
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    failed: str | None = None
    created: float = field(default_factory=time.monotonic)
    timer: asyncio.TimerHandle | None = None


class KvSideChannel:
    """The prefill side: KV held per key, served to decode sims over a ZMQ ROUTER.

    `release(req_key) -> bool` frees an engine request's held blocks (the engine's); `lease_s` is how
    long unread KV is kept (renewed by heartbeats); `clock` is monotonic seconds."""

    def __init__(self, host: str, port: int, release: Callable[[str], bool], lease_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.host, self.port = host, port
        self._release = release
        self.lease_s = lease_s
        self.clock = clock
        self.entries: dict[str, _Held] = {}
        self.by_req: dict[str, str] = {}
        self.stats = {"pulled": 0, "expired": 0, "aborted": 0, "unknown": 0}
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._send_lock = asyncio.Lock()
        self._handlers: set[asyncio.Task[None]] = set()

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        bind_host = "127.0.0.1" if self.host in ("localhost", "") else self.host
        if self.port == 0:  # an OS-assigned ephemeral port (pyzmq's bind_to_random_port picks blindly in 49152+)
            self._sock.bind(f"tcp://{bind_host}:*")
            self.port = int(self._sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        else:
            self._sock.bind(f"tcp://{bind_host}:{self.port}")
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def close(self) -> None:
        for t in [self._task, *self._handlers]:
            if t is not None:
                t.cancel()
        for t in [self._task, *self._handlers]:
            if t is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        for e in self.entries.values():
            if e.timer is not None:
                e.timer.cancel()
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()

    # ---- the prefill request's side ------------------------------------------------------------
    def expect(self, key: str, req_key: str) -> None:
        """A prefill request for `key` was submitted as engine request `req_key`."""
        e = self.entries.get(key)
        if e is None or e.held or e.failed:
            e = self.entries[key] = _Held(key)
        e.req_key = req_key
        self.by_req[req_key] = key

    def on_held(self, req_key: str, num_tokens: int) -> None:
        """The prefill finished and its blocks are held: readable until pulled or the lease ends."""
        key = self.by_req.get(req_key)
        e = self.entries.get(key) if key is not None else None
        if e is None:
            self._release(req_key)
            return
        e.held, e.num_tokens = True, num_tokens
        if e.abandoned:
            self._free(e, "aborted")
            return
        e.deadline = self.clock() + self.lease_s
        e.ready.set()
        self._arm(e)

    def on_failed(self, req_key: str, reason: str) -> None:
        """The prefill request ended without holding KV (aborted, error): waiting decodes fail now."""
        key = self.by_req.pop(req_key, None)
        e = self.entries.get(key) if key is not None else None
        if e is None or e.held:
            return
        e.failed = reason
        e.ready.set()
        if not e.reading:
            self.entries.pop(e.key, None)

    @property
    def num_held(self) -> int:
        return sum(1 for e in self.entries.values() if e.held)

    # ---- internals -----------------------------------------------------------------------------
    def _arm(self, e: _Held) -> None:
        if e.timer is not None:
            e.timer.cancel()
        delay = max(0.0, e.deadline - self.clock())
        e.timer = asyncio.get_running_loop().call_later(delay, self._expire, e)

    def _expire(self, e: _Held) -> None:
        e.timer = None
        if self.entries.get(e.key) is not e or e.reading:
            return
        if self.clock() < e.deadline:  # renewed by a heartbeat meanwhile
            self._arm(e)
            return
        log.info("releasing expired KV blocks of %s (lease %.1fs)", e.key, self.lease_s)
        self._free(e, "expired")

    def _free(self, e: _Held, why: str) -> None:
        self.entries.pop(e.key, None)
        if e.timer is not None:
            e.timer.cancel()
            e.timer = None
        if e.req_key is not None:
            self.by_req.pop(e.req_key, None)
            if e.held:
                self._release(e.req_key)
        e.held = False
        if why in self.stats:
            self.stats[why] += 1

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if len(frames) < 2:
                continue
            try:
                msg = _dec.decode(frames[-1])
            except msgspec.DecodeError:
                log.warning("malformed KV side-channel message")
                continue
            if not isinstance(msg, dict):
                continue
            t = asyncio.get_running_loop().create_task(self._handle(frames[0], msg))
            self._handlers.add(t)
            t.add_done_callback(self._handlers.discard)

    async def _reply(self, ident: bytes, body: dict[str, Any]) -> None:
        assert self._sock is not None
        async with self._send_lock:
            with contextlib.suppress(zmq.ZMQError):
                await self._sock.send_multipart((ident, b"", _enc.encode(body)))

    async def _handle(self, ident: bytes, msg: dict[str, Any]) -> None:
        op, key = msg.get("op"), str(msg.get("key", ""))
        if op == "pull":
            await self._reply(ident, await self._pull(key, float(msg.get("wait_s") or 0.0)))
        elif op == "done":
            e = self.entries.get(key)
            if e is not None and e.held:
                self.stats["pulled"] += 1
                self._free(e, "")
            await self._reply(ident, {"ok": True})
        elif op == "abort":
            e = self.entries.get(key)
            if e is not None:
                if e.held:
                    self._free(e, "aborted")
                else:
                    e.abandoned = True
                    if e.req_key is None:  # the prefill never came: forget the room
                        self.entries.pop(key, None)
            await self._reply(ident, {"ok": True})
        elif op == "heartbeat":
            now = self.clock()
            for k in msg.get("keys") or ():
                e = self.entries.get(str(k))
                if e is not None and e.held:
                    e.deadline = max(e.deadline, now + self.lease_s)
            await self._reply(ident, {"ok": True})
        else:
            await self._reply(ident, {"ok": False, "error": f"unknown op {op!r}"})

    async def _pull(self, key: str, wait_s: float) -> dict[str, Any]:
        e = self.entries.get(key)
        if e is None and wait_s > 0:  # SGLang: the decode may get the body before the prefill does
            e = self.entries[key] = _Held(key)
        if e is None:
            self.stats["unknown"] += 1
            return {"ok": False, "error": f"no KV held for request {key} (unknown, expired or already read)"}
        if not e.ready.is_set():
            try:
                await asyncio.wait_for(e.ready.wait(), timeout=wait_s)
            except asyncio.TimeoutError:
                if e.req_key is None:
                    self.entries.pop(key, None)
                else:
                    e.abandoned = True
                return {"ok": False, "error": f"KV for {key} not ready within {wait_s:.1f}s"}
        if e.failed is not None or not e.held or self.entries.get(key) is not e:
            return {"ok": False, "error": f"prefill of {key} failed: {e.failed or 'KV released'}"}
        e.reading = True
        return {"ok": True, "num_tokens": e.num_tokens}


# --------------------------------------------------------------------------------------------------
# The runtime: flavors' request handling around the engine
# --------------------------------------------------------------------------------------------------


class DisaggRuntime:
    """One sim's disaggregation state: the side channel it serves (prefill) and the pulls it makes (decode).

    Built by the server from the config; the HTTP handlers call `classify` / `submitted` /
    `prefill_extras`, the engine calls `load` (a decode's pull), `on_held` and `on_ended`."""

    def __init__(self, flavor: str, *, transfer: KvTransferModel, side_host: str, side_port: int, lease_s: float,
                 timeout_s: float, kv_transfer: KvTransferConfig | None = None, sglang_mode: str = "null",
                 tp_size: int = 1, serve: bool = True, release: Callable[[str], bool] | None = None) -> None:
        self.flavor = flavor
        self.transfer = transfer
        self.kv_transfer = kv_transfer
        self.sglang_mode = sglang_mode
        self.timeout_s = timeout_s
        self.tp_size = tp_size
        # the host a decode is told to dial (TRT-LLM's opaque state); a wildcard bind advertises the host name
        self.side_host = socket.gethostname() if side_host in ("0.0.0.0", "::", "") else side_host
        self.engine_id = kv_transfer.engine_id if kv_transfer is not None else uuid.uuid4().hex
        self.channel = KvSideChannel(side_host, side_port, release or (lambda _k: False), lease_s) if serve else None
        self.lease_s = lease_s
        self._ctx: zmq.asyncio.Context | None = None
        self.prefills: dict[str, Handoff] = {}  # engine request id -> prefill hand-off
        self.decodes: dict[str, RemoteSource] = {}  # engine request id -> decode source, until it ends
        self._ctx_ids = itertools.count(random.getrandbits(40) << 12)
        self._heartbeat: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[Any]] = set()

    @property
    def side_port(self) -> int:
        return self.channel.port if self.channel is not None else 0

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        if self.channel is not None:
            self.channel.start()
        if self.flavor == "vllm":
            self._heartbeat = asyncio.get_running_loop().create_task(self._heartbeats())

    async def close(self) -> None:
        for t in [self._heartbeat, *self._bg]:
            if t is not None:
                t.cancel()
        for t in [self._heartbeat, *self._bg]:
            if t is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        if self.channel is not None:
            await self.channel.close()
        if self._ctx is not None:
            self._ctx.term()

    # ---- HTTP side -----------------------------------------------------------------------------
    def classify(self, extra: dict[str, Any]) -> Handoff | list[str] | None:
        """A request's role from its body fields (`extra`: the raw body dict). Returns None (a plain
        request), a Handoff, or the names of missing fields (SGLang/TRT-LLM decode/prefill: a 400)."""
        if self.flavor == "vllm":
            return self._classify_vllm(extra.get("kv_transfer_params"))
        if self.flavor == "sglang":
            if self.sglang_mode == "null":
                return None
            boot = sglang_bootstrap(extra)
            if isinstance(boot, list):
                return boot
            host, port, room = boot
            if self.sglang_mode == "prefill":
                return Handoff("prefill", key=str(room), max_tokens=1)
            return Handoff("decode", remote=RemoteSource(host, port, str(room), wait_s=self.timeout_s))
        return self._classify_trtllm(extra.get("disaggregated_params"))

    def _classify_vllm(self, params: Any) -> Handoff | None:
        if not isinstance(params, dict):
            return None
        role = vllm_role(params)
        if role == "prefill":
            return Handoff("prefill")
        if role == "decode":
            recompute = self.kv_transfer is not None and self.kv_transfer.kv_load_failure_policy == "recompute"
            missing = vllm_missing_fields(params)
            port = params.get("remote_port")
            src = RemoteSource(str(params.get("remote_host") or ""), port if isinstance(port, int) else 0,
                               str(params.get("remote_request_id") or ""), recompute_on_failure=recompute)
            if missing:  # vLLM: "Got invalid KVTransferParams ... will not utilize KVTransfer"
                src.state, src.error = "failed", f"invalid kv_transfer_params: missing {', '.join(missing)}"
            cached = params.get("remote_prefill_cached_tokens")
            return Handoff("decode", remote=src, remote_cached_tokens=cached if isinstance(cached, int) and not isinstance(cached, bool) else None)
        return None

    def _classify_trtllm(self, params: Any) -> Handoff | list[str] | None:
        if params is None:
            return None
        if not isinstance(params, dict) or not isinstance(params.get("request_type"), str):
            return ["disaggregated_params.request_type"]
        kind = params["request_type"]
        if kind == "context_only":
            ctx_id = next(self._ctx_ids)
            return Handoff("prefill", key=str(ctx_id), max_tokens=1, ctx_request_id=ctx_id,
                           disagg_request_id=params.get("disagg_request_id"))
        if kind == "generation_only":
            try:
                state = decode_opaque_state(params.get("encoded_opaque_state"))
            except ValueError as exc:
                return [f"disaggregated_params.encoded_opaque_state ({exc})"]
            if params.get("ctx_request_id") is not None and params["ctx_request_id"] != state["ctx_request_id"]:
                return ["disaggregated_params.ctx_request_id (does not match encoded_opaque_state)"]
            return Handoff("decode", remote=RemoteSource(state["host"], state["port"], str(state["ctx_request_id"])))
        if kind == "context_and_generation":
            return None
        return [f"disaggregated_params.request_type ({kind!r} is not context_only, generation_only or context_and_generation)"]

    def submitted(self, req_key: str, h: Handoff) -> None:
        """Right after engine.submit (no await in between)."""
        if h.role == "prefill":
            if not h.key:
                h.key = req_key
            self.prefills[req_key] = h
            if self.channel is not None:
                self.channel.expect(h.key, req_key)
        else:
            assert h.remote is not None
            self.decodes[req_key] = h.remote

    def prefill_extras(self, req_key: str, h: Handoff, blocks: list[int], num_tokens: int, num_cached: int,
                       first_tokens: list[int]) -> dict[str, Any]:
        """The fields a finished prefill's (non-streaming) response carries."""
        if self.flavor == "vllm":
            assert self.kv_transfer is not None
            return {"kv_transfer_params": {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(blocks)],
                "remote_engine_id": self.engine_id, "remote_request_id": h.key, "remote_host": self.side_host,
                "remote_port": self.side_port, "tp_size": self.tp_size, "dcp_size": 1, "pp_size": 1,
                "remote_num_tokens": num_tokens, "remote_blocks_expiry_time": None, "transfer_mode": "pull",
                "remote_prefill_cached_tokens": num_cached,
            }}  # fmt: skip
        if self.flavor == "trtllm":
            state = {"host": self.side_host, "port": self.side_port, "ctx_request_id": h.ctx_request_id,
                     "engine_id": self.engine_id, "num_tokens": num_tokens}
            return {"disaggregated_params": {
                "request_type": "context_only", "first_gen_tokens": list(first_tokens),
                "ctx_request_id": h.ctx_request_id, "encoded_opaque_state": encode_opaque_state(state),
                "draft_tokens": None, "disagg_request_id": h.disagg_request_id,
            }}  # fmt: skip
        return {}

    def notify_rejected(self, params: dict[str, Any]) -> None:
        """vLLM `_with_kv_transfer_rejection_cleanup`: a decode request refused before it reached the
        engine still tells its prefill to free the blocks."""
        host, port, key = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
        if isinstance(host, str) and isinstance(port, int) and key is not None:
            self._spawn(self._call(host, port, {"op": "abort", "key": str(key)}, CALL_TIMEOUT_S))

    # ---- engine side ---------------------------------------------------------------------------
    def on_held(self, req_key: str, num_tokens: int) -> bool:
        """A finished prefill's blocks are held; False = this sim does not hold them (free now)."""
        if req_key not in self.prefills or self.channel is None:
            return False
        self.channel.on_held(req_key, num_tokens)
        return True

    def forget_prefill(self, req_key: str) -> Handoff | None:
        return self.prefills.pop(req_key, None)

    def on_ended(self, req_key: str, reason: str) -> None:
        """An engine request ended (finished, aborted or failed)."""
        h = self.prefills.get(req_key)
        if h is not None and reason not in ("length", "stop") and self.channel is not None:
            self.channel.on_failed(req_key, reason)
            self.prefills.pop(req_key, None)
        src = self.decodes.pop(req_key, None)
        if src is not None and src.state in ("pending", "pulling") and src.host and src.port:
            # vLLM: a decode that ends before reading notifies its prefill (abort_immediately / request_finished)
            self._spawn(self._call(src.host, src.port, {"op": "abort", "key": src.key}, CALL_TIMEOUT_S))
            src.state = "failed"

    async def load(self, src: RemoteSource, num_prompt_tokens: int, num_local_tokens: int) -> bool:
        """Pull a decode's prompt KV (all but `num_local_tokens` prefix-cache hits); True when loaded."""
        if src.state == "failed":  # invalid params, found at classify time
            return False
        src.state = "pulling"
        loop = asyncio.get_running_loop()
        start = loop.time()
        reply = await self._call(src.host, src.port, {"op": "pull", "key": src.key, "wait_s": src.wait_s},
                                 src.wait_s + CALL_TIMEOUT_S)
        if src.wait_s > 0:  # SGLang: the answer waited for the prefill; the transfer starts now
            start = loop.time()
        if not reply.get("ok"):
            src.state, src.error = "failed", str(reply.get("error") or "KV pull failed")
            return False
        remote_tokens = reply.get("num_tokens")
        if self.flavor != "vllm" and remote_tokens != num_prompt_tokens:
            src.error = f"prefill KV covers {remote_tokens} tokens, the request has {num_prompt_tokens}"
            await self._call(src.host, src.port, {"op": "abort", "key": src.key}, CALL_TIMEOUT_S)
            src.state = "failed"
            return False
        tokens = max(0, min(int(remote_tokens or 0), num_prompt_tokens) - num_local_tokens)
        try:  # deadline from the pull's start: the side channel's own round trip is part of the modelled time
            await asyncio.sleep(max(0.0, start + self.transfer.seconds(tokens) - loop.time()))
        except asyncio.CancelledError:
            src.state = "failed"
            self._spawn(self._call(src.host, src.port, {"op": "abort", "key": src.key}, CALL_TIMEOUT_S))
            raise
        src.state, src.loaded_tokens = "done", tokens
        self._spawn(self._call(src.host, src.port, {"op": "done", "key": src.key}, CALL_TIMEOUT_S))
        return True

    # ---- internals -----------------------------------------------------------------------------
    async def _call(self, host: str, port: int, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if self._ctx is None:
            return {"ok": False, "error": "side channel not started"}
        return await side_channel_call(self._ctx, host, port, msg, timeout_s)

    def _spawn(self, coro: Any) -> None:
        try:
            t = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no loop (unit tests of the pure parts)
            coro.close()
            return
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _heartbeats(self) -> None:
        """vLLM: decode requests still waiting to read renew their prefill's lease every lease/6."""
        interval = max(0.05, self.lease_s / 6)
        while True:
            await asyncio.sleep(interval)
            groups: dict[tuple[str, int], list[str]] = {}
            for src in self.decodes.values():
                if src.state == "pending" and src.host and src.port:
                    groups.setdefault((src.host, src.port), []).append(src.key)
            for (host, port), keys in groups.items():
                self._spawn(self._call(host, port, {"op": "heartbeat", "keys": keys}, CALL_TIMEOUT_S))
