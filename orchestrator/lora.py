"""LoRA adapters in the frontend: names, on-demand loading on the engines, a per-worker cap with LRU unload.

    spec = lora.resolve(model)                   the configured adapter named `model`, or None (a base model)
    lora.annotate(endpoints)                     each endpoint's `adapters` = what this frontend loaded there
    ranked = await lora.prepare(spec, ranked)    the first worker of the router's ranking that has, or now loads,
                                                 the adapter, then the other holders (the failover order)
    lora.begin(request_id, worker, name) / end(request_id)   requests in flight on an adapter (never unloaded
                                                              under them)

Loading goes through the engine's own API (workers/<backend>/features.py: vLLM `POST /v1/load_lora_adapter`,
SGLang `POST /load_lora_adapter`). A worker keeps at most `max_per_worker` adapters loaded by this frontend: the
least recently used one with no request in flight is unloaded once a new one has loaded (if every one is busy, the
cap is exceeded until one frees up, and the engine's own limit decides). An engine that already holds an adapter (loaded before
this frontend started) counts as loaded. A load that fails (the engine refuses, times out or is unreachable)
marks the (worker, adapter) pair as failing for `failure_backoff_s`: the request goes on to the next worker of the
ranking, and that worker is not asked to load the adapter again until the backoff ends. When no worker can load
it, the request fails with a 503 naming the adapter and the engine's last error.

Routing: the router's LoRA stage (router/plugins/lora.py) puts holders first, and the block hashes carry the
adapter's name, as the engine's cache keys do, so the adapter's prefix is routed to where it is cached.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from orchestrator.errors import ServiceUnavailableError
from router import Endpoint

__all__ = ["LoraAdapterSpec", "LoraConfig", "LoraLoadError", "LoraManager"]

log = logging.getLogger("kvyard.lora")

_FEATURES = {"vllm": "workers.vllm.features", "sglang": "workers.sglang.features"}


class LoraAdapterSpec(BaseModel):
    """One adapter the frontend may serve."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=256, pattern=r"^[^\s/]+$", description="the `model` clients ask for")
    path: str = Field(min_length=1, description="the adapter folder as the engines see it (PEFT format)")
    base_model: str = Field(min_length=1, description="served model name of the base model it applies to")


class LoraConfig(BaseModel):
    """LoRA adapters served on the base models' workers (YAML `frontend.lora`)."""

    model_config = ConfigDict(extra="forbid")

    adapters: list[LoraAdapterSpec] = Field(default_factory=list, description="adapters clients may name as `model`")
    max_per_worker: int = Field(4, ge=1, description="adapters this frontend keeps loaded per worker; LRU idle ones unloaded past it")
    load_timeout_s: float = Field(120.0, gt=0, description="longest wait for an engine to load an adapter")
    failure_backoff_s: float = Field(60.0, gt=0, description="a worker that failed to load an adapter is not asked again for this long")
    max_load_gap: float = Field(4.0, ge=0, description="router: a holder more than this many requests above the least loaded worker loses its preference")
    max_lora_rank: int = Field(16, ge=1, description="`kvyard up`: --max-lora-rank of the engines it starts (the largest adapter rank)")

    @model_validator(mode="after")
    def _unique(self) -> LoraConfig:
        names = [a.name for a in self.adapters]
        dup = [n for n, c in Counter(names).items() if c > 1]
        if dup:
            raise ValueError(f"adapter names must be unique; repeated: {', '.join(dup)}")
        clash = {a.name for a in self.adapters} & {a.base_model for a in self.adapters}
        if clash:
            raise ValueError(f"an adapter cannot share its name with a base model: {', '.join(sorted(clash))}")
        return self


class LoraLoadError(Exception):
    """An engine could not load an adapter (the message names both and says why)."""


def features_of(protocol: str):
    """The backend module that knows the engine's LoRA API (None: the engine has no runtime loading)."""
    mod = _FEATURES.get(protocol)
    return importlib.import_module(mod) if mod else None


class LoraManager:
    def __init__(self, cfg: LoraConfig, protocol_of: Callable[[str], str | None], clock: Callable[[], float] = time.monotonic,
                 http: httpx.AsyncClient | None = None) -> None:
        """`protocol_of(worker_id)` names a live worker's engine API ("vllm", "sglang", ...; None when gone)."""
        self.cfg = cfg
        self.by_name = {a.name: a for a in cfg.adapters}
        self.protocol_of = protocol_of
        self.clock = clock
        self.http = http or httpx.AsyncClient(timeout=httpx.Timeout(cfg.load_timeout_s, connect=5.0))
        self._loaded: dict[str, OrderedDict[str, None]] = {}  # worker -> adapters, least recently used first
        self._inflight: Counter[tuple[str, str]] = Counter()  # (worker, adapter) -> requests in flight
        self._active: dict[str, tuple[str, str]] = {}  # request id -> (worker, adapter)
        self._failed: dict[tuple[str, str], tuple[float, str]] = {}  # (worker, adapter) -> (retry after, why)
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}  # one load at a time per (worker, adapter); kept
        self.loads = Counter()  # outcomes: loaded, already_loaded, failed, unloaded

    # ---- lookups (sync) -------------------------------------------------------------------------

    def resolve(self, model: str) -> LoraAdapterSpec | None:
        return self.by_name.get(model)

    def adapters_of(self, worker_id: str) -> list[str]:
        return list(self._loaded.get(worker_id, ()))

    def annotate(self, endpoints: list[Endpoint]) -> list[Endpoint]:
        for ep in endpoints:
            ep.adapters = frozenset(self._loaded.get(ep.worker_id, ()))
        return endpoints

    def holders(self, name: str, endpoints: list[Endpoint]) -> list[Endpoint]:
        return [ep for ep in endpoints if name in self._loaded.get(ep.worker_id, ())]

    def failing(self) -> list[dict]:
        now = self.clock()
        return [{"worker_id": w, "adapter": a, "retry_in_s": round(until - now, 1), "error": why}
                for (w, a), (until, why) in sorted(self._failed.items()) if until > now]

    def begin(self, request_id: str, worker_id: str, name: str) -> None:
        """A request runs on the adapter on this worker (again after a failover: the old worker is released)."""
        self.end(request_id)
        self._active[request_id] = (worker_id, name)
        self._inflight[(worker_id, name)] += 1

    def end(self, request_id: str) -> None:
        """The request is over (idempotent)."""
        key = self._active.pop(request_id, None)
        if key is None:
            return
        self._inflight[key] -= 1
        if self._inflight[key] <= 0:
            del self._inflight[key]

    def forget_worker(self, worker_id: str) -> None:
        self._loaded.pop(worker_id, None)
        for table in (self._failed, self._locks):
            for key in [k for k in table if k[0] == worker_id]:
                del table[key]

    # ---- loading (async, at the edge) ------------------------------------------------------------

    async def prepare(self, spec: LoraAdapterSpec, ranked: list[Endpoint]) -> list[Endpoint]:
        """The ranking from the first worker that has or can load the adapter, then the other holders.

        Raises ServiceUnavailableError (503) when none can: every candidate failed to load it now or recently."""
        last = None
        now = self.clock()
        for ep in ranked:
            fail = self._failed.get((ep.worker_id, spec.name))
            if fail is not None and fail[0] > now:
                last = last or fail[1]
                continue
            try:
                await self.ensure(ep, spec)
            except LoraLoadError as exc:
                last = str(exc)
                self._failed[(ep.worker_id, spec.name)] = (self.clock() + self.cfg.failure_backoff_s, last)
                self.loads["failed"] += 1
                log.warning("%s (not retried on that worker for %.0f s)", exc, self.cfg.failure_backoff_s)
                continue
            self._failed.pop((ep.worker_id, spec.name), None)
            return [ep, *(e for e in self.holders(spec.name, ranked) if e is not ep)]
        wait = min((until for (w, a), (until, _) in self._failed.items() if a == spec.name), default=now + 1) - now
        raise ServiceUnavailableError(f"LoRA adapter `{spec.name}` could not be loaded on any worker of `{spec.base_model}`: {last}",
                                      code="adapter_load_failed", retry_after=max(1.0, wait))

    async def ensure(self, ep: Endpoint, spec: LoraAdapterSpec) -> None:
        """Make sure the adapter is loaded on the endpoint's engine (LoraLoadError when it cannot be)."""
        wid = ep.worker_id
        key = (wid, spec.name)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            loaded = self._loaded.setdefault(wid, OrderedDict())
            if spec.name in loaded:
                loaded.move_to_end(spec.name)
                return
            feats = features_of(self.protocol_of(wid) or "")
            if feats is None:
                raise LoraLoadError(f"worker {wid} cannot load LoRA adapter `{spec.name}`: its engine has no runtime adapter loading")
            await self._post(ep, feats.LOAD_PATH, feats.load_body(spec.name, spec.path), spec.name, feats)
            loaded[spec.name] = None
            await self._make_room(ep, loaded, feats)  # after the load: a failed load evicts nothing

    async def _make_room(self, ep: Endpoint, loaded: OrderedDict, feats) -> None:
        """Unload least recently used idle adapters (never the newest) until at most max_per_worker are loaded."""
        while len(loaded) > self.cfg.max_per_worker:
            newest = next(reversed(loaded))
            idle = next((a for a in loaded if a != newest and not self._inflight.get((ep.worker_id, a))), None)
            if idle is None:
                log.info("worker %s: all %d adapters busy; loading one more than max_per_worker", ep.worker_id, len(loaded))
                return
            del loaded[idle]
            try:
                resp = await self.http.post(ep.url + feats.UNLOAD_PATH, json=feats.unload_body(idle))
                self.loads["unloaded"] += 1
                if resp.status_code >= 400 and resp.status_code != 404:
                    log.warning("worker %s: unloading adapter %s answered HTTP %d", ep.worker_id, idle, resp.status_code)
            except httpx.HTTPError as exc:
                log.warning("worker %s: unloading adapter %s failed: %s", ep.worker_id, idle, exc)

    async def _post(self, ep: Endpoint, path: str, body: dict, name: str, feats) -> None:
        try:
            resp = await self.http.post(ep.url + path, json=body)
        except httpx.HTTPError as exc:
            raise LoraLoadError(f"worker {ep.worker_id} could not load LoRA adapter `{name}`: {type(exc).__name__}: {exc}") from exc
        text = resp.text
        if feats.already_loaded(resp.status_code, text):
            self.loads["already_loaded"] += 1
            return
        failed = resp.status_code >= 400
        if not failed:
            try:
                failed = json.loads(text).get("success") is False  # SGLang answers 200 with success: false
            except (ValueError, AttributeError):
                pass
        if failed:
            raise LoraLoadError(f"worker {ep.worker_id} could not load LoRA adapter `{name}`: HTTP {resp.status_code} {_short(text)}")
        self.loads["loaded"] += 1
        log.info("worker %s: loaded LoRA adapter %s", ep.worker_id, name)

    async def close(self) -> None:
        await self.http.aclose()


def _short(text: str) -> str:
    try:
        body = json.loads(text)
        msg = (body.get("error") or {}).get("message") if isinstance(body.get("error"), dict) else body.get("message") or body.get("error_message")
        if msg:
            return str(msg)[:300]
    except (ValueError, AttributeError):
        pass
    return text[:300]
