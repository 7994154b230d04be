"""KV-event publishing over ZMQ, exactly like vLLM 0.32's `ZmqEventPublisher` (vllm/distributed/kv_events.py).

Used by the sim engine (`workers/sim`) and by the TensorRT-LLM worker's event relay
(`workers/trtllm/relay.py`), which republishes the events it drains from trtllm-serve.

- PUB socket (send HWM = `hwm`): binds when the endpoint contains `*` or `::` or starts with
  `ipc://` / `inproc://`, else connects. `tcp://*:0` binds an ephemeral port on 127.0.0.1.
- One message per engine step that has events: `[topic, seq (8-byte big-endian, from 0), payload]`,
  payload = `workers.vllm.kv_events.encode_batch(time.time(), events, dp_rank=0)`.
- Replay: a ROUTER on `replay_endpoint` keeps the last `buffer_steps` batches. A request
  `[identity, b"", start_seq]` gets `[identity, b"", topic, seq, payload]` for each buffered batch with
  seq >= start_seq, then `[identity, b"", b"", END_SEQ (-1, signed 8 bytes), b""]`.

`publish()` is a non-blocking send from the engine loop; the replay socket is served by an asyncio
task (`zmq.asyncio`) on the same loop, so nothing blocks the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import zmq
import zmq.asyncio

from router.kv_events import KvEvent
from workers.vllm.kv_events import encode_batch

__all__ = ["KvEventPublisher", "PublisherSettings", "is_bind_endpoint"]

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class PublisherSettings(Protocol):
    """What the publisher reads of a KV-events config (vLLM's `KVEventsConfig` fields)."""

    endpoint: str
    replay_endpoint: str | None
    topic: str
    hwm: int
    buffer_steps: int


def is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    def __init__(self, cfg: PublisherSettings, dp_rank: int = 0,
                 encode: Callable[[float, list[KvEvent], int | None], bytes] | None = None,
                 transform: Callable[[list[KvEvent]], list[KvEvent]] | None = None) -> None:
        """`encode(ts, events, dp_rank)` / `transform(events)`: another engine's payload (SGLang flavor)."""
        self.cfg = cfg
        self._encode = encode or (lambda ts, events, dp: encode_batch(ts, events, dp_rank=dp))
        self._transform = transform
        self.topic = cfg.topic.encode()
        self.dp_rank = dp_rank
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, cfg.buffer_steps))
        self.endpoint = cfg.endpoint
        self.replay_endpoint = cfg.replay_endpoint
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    @staticmethod
    def _bind(sock: zmq.Socket, endpoint: str) -> str:
        if endpoint == "tcp://*:0":  # an OS-assigned ephemeral port, like the kernel gives free_port()
            sock.bind("tcp://127.0.0.1:*")
            return sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        sock.bind(endpoint)
        return endpoint

    def start(self) -> None:
        """Open the sockets (call from the running event loop)."""
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(self.cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if is_bind_endpoint(self.endpoint):
            self.endpoint = self._bind(self._pub, self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        if self.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._bind(self._replay, self.replay_endpoint)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[KvEvent]) -> None:
        if not events or self._pub is None:
            return
        if self._transform is not None:
            events = self._transform(events)
        payload = self._encode(time.time(), events, self.dp_rank)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # HWM reached: dropped, like a slow PUB subscriber in vLLM
            pass

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            try:
                frames = await sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if len(frames) != 3:
                log.warning("invalid replay request: %d frames", len(frames))
                continue
            client, _, raw = frames
            start = int.from_bytes(raw, "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await sock.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            await sock.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()
