"""The frontend's live view of the workers: discovery refresh + engine metric scrapes.

Two loops (observe only; the router decides):
  refresh: every refresh_interval_s, list workers from discovery; new ones join (scraped once first),
           vanished ones (lease lapsed or deregistered) leave routing and the router forgets their load.
           If discovery is unreachable the last known view is kept.
  scrape:  every scrape_interval_s, GET each engine's metrics endpoint (at most scrape_timeout_s) and
           keep the normalised snapshot (waiting queue, KV usage) for the load scorers. Each worker's
           scrape runs on its own, so one engine that never answers delays no other's. After
           `liveness_failures` failed scrapes in a row the `on_worker_unresponsive` hooks run (the
           service confirms with the engine's health check, then opens the worker's breaker and fails
           over its requests in flight): an engine that accepts connections and never answers, or a
           SIGSTOPped one, is out of routing within about liveness_failures x (scrape_interval_s +
           scrape_timeout_s) + health_probe_timeout_s seconds.
"""

from __future__ import annotations

import asyncio
import logging
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.engine_client import EngineClient, EngineStreamError, EngineUnreachableError
from orchestrator.tokenizer import load_tokenizer
from router import Endpoint, EndpointLoad, Router
from router.events import KvEventIngestor
from workers.discovery import Discovery, DiscoveryError, files_digest
from workers.registry import get_backend
from workers.types import EngineMetrics, WorkerFailure, WorkerInfo, WorkerState

__all__ = ["WorkerPool", "LiveWorker"]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]

log = logging.getLogger("kvyard.pool")


@dataclass(slots=True)
class LiveWorker:
    info: WorkerInfo
    metrics: EngineMetrics | None = None
    scrape_errors: int = 0  # failed scrapes in a row
    extra: dict = field(default_factory=dict)
    scrape_task: asyncio.Task | None = None


class WorkerPool:
    def __init__(self, discovery: Discovery, router: Router, refresh_interval_s: float = 1.0, scrape_interval_s: float = 1.0,
                 cache_dir: str | Path | None = None, ingestor: KvEventIngestor | None = None, *,
                 scrape_timeout_s: float = 2.0, liveness_failures: int = 2, fast_bpe: bool = True) -> None:
        self.discovery = discovery
        self.fast_bpe = fast_bpe  # tokenizers load with orchestrator/fast_bpe.py's encoder where it is exact
        self.router = router
        self.refresh_interval_s = refresh_interval_s
        self.scrape_interval_s = scrape_interval_s
        self.workers: dict[str, LiveWorker] = {}
        self.failures: list[WorkerFailure] = []  # workers that gave up (reported to discovery), newest first
        self.known_models: set[str] = set()
        self.discovery_ok = True
        self.ingestor = ingestor  # feeds the router's KV index from each worker's KV events
        self.tokenizer_dirs: dict[str, str] = {}  # model -> local folder with tokenizer.json
        self.cache_dir = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "kvyard-tokenizers"
        self._tasks: list[asyncio.Task] = []
        self._refresh_lock = asyncio.Lock()
        self.scrape_timeout_s = scrape_timeout_s
        self._client = EngineClient(scrape_timeout_s)  # the token path's client: a scrape costs a fraction of httpx's
        self.liveness_failures = liveness_failures  # failed scrapes in a row that make a worker unresponsive; 0: never
        self.on_worker_left: list[Callable[[str], None]] = []  # called with the worker id after the router forgot it
        self.on_worker_joined: list[Callable[[LiveWorker], None]] = []  # called once it is routable, after its first scrape
        self.on_worker_unresponsive: list[Callable[[str, str], None]] = []  # (worker id, why) after liveness_failures scrapes
        self.on_tokenizer_ready: list[Callable[[str], None]] = []  # called with the model once its tokenizer loaded and was checked
        self._side: set[asyncio.Task] = set()  # one-off tasks (tokenizer-ready hooks), cancelled on close

    async def start(self) -> None:
        await self.refresh()
        self._tasks = [asyncio.create_task(self._loop(self.refresh, self.refresh_interval_s)),
                       asyncio.create_task(self._loop(self._start_scrapes, self.scrape_interval_s))]

    async def close(self) -> None:
        scrapes = [w.scrape_task for w in self.workers.values() if w.scrape_task is not None]
        side = list(self._side)
        for t in self._tasks + scrapes + side:
            t.cancel()
        await asyncio.gather(*self._tasks, *scrapes, *side, return_exceptions=True)
        await self._client.close()
        if self.ingestor is not None:
            await self.ingestor.close()

    async def _loop(self, fn, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                out = fn()
                if asyncio.iscoroutine(out):
                    await out
            except Exception:  # a loop must outlive any one bad round
                log.exception("%s failed", fn.__name__)

    async def refresh(self) -> None:
        """Re-read the registry: workers that left are forgotten, new ones scraped once and joined. One at a time (a
        caller's refresh and the pool's own loop would otherwise both join a new worker, the later replacing the
        other's LiveWorker and its first metrics)."""
        async with self._refresh_lock:
            await self._refresh()

    async def _refresh(self) -> None:
        try:
            infos = await self.discovery.list_workers()
        except DiscoveryError as exc:
            if self.discovery_ok:
                log.warning("discovery unreachable, serving the last known %d workers: %s", len(self.workers), exc)
            self.discovery_ok = False
            return
        self.discovery_ok = True
        try:
            self.failures = await self.discovery.list_failures()
        except (DiscoveryError, AttributeError):  # AttributeError: a Discovery without failure reports
            pass
        seen = {i.worker_id for i in infos}
        for wid in [w for w in self.workers if w not in seen]:
            log.info("worker %s left", wid)
            gone = self.workers.pop(wid)
            if gone.scrape_task is not None:
                gone.scrape_task.cancel()
            self.router.remove_worker(wid)
            for forget in self.on_worker_left:  # e.g. the disagg prefill router's own load book
                forget(wid)
        joined = []
        for info in infos:
            live = self.workers.get(info.worker_id)
            if live is None:
                joined.append(LiveWorker(info))
            else:
                live.info = info
        # scraped once before they become routable, so the counters telemetry diffs start before this frontend's traffic
        await asyncio.gather(*(self._scrape_one(live) for live in joined))
        for live in joined:
            log.info("worker %s joined: %s %s at %s", live.info.worker_id, live.info.backend, live.info.model, live.info.url)
            self.workers[live.info.worker_id] = live
            for hook in self.on_worker_joined:
                hook(live)
        if self.ingestor is not None:  # no await since the joined/left loop: index and pool agree
            self.ingestor.sync([w.info for w in self.workers.values()])
        for info in infos:
            self.known_models.add(info.model)
            if info.model not in self.tokenizer_dirs:
                await self._resolve_tokenizer(info)

    async def _resolve_tokenizer(self, info: WorkerInfo) -> None:
        """The worker's tokenizer path if readable here, else the files it published to discovery."""
        if info.tokenizer and (Path(info.tokenizer) / "tokenizer.json").is_file():
            await self._preload(info.model, info.tokenizer)
            return
        try:
            files = await self.discovery.fetch_files(info.model)
        except DiscoveryError:
            return
        if "tokenizer.json" not in files:
            return
        folder = self.cache_dir / f"{_safe(info.model)}-{files_digest(files)[:16]}"
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            if "/" not in name and not name.startswith("."):
                (folder / name).write_bytes(data)
        log.info("tokenizer of %s fetched from discovery into %s", info.model, folder)
        await self._preload(info.model, str(folder))

    async def _preload(self, model: str, folder: str) -> None:
        """Load the tokenizer off the event loop (a large vocabulary takes a second or more to parse);
        requests use it only once it is ready, so none ever waits on the load."""
        try:
            tok = await asyncio.to_thread(load_tokenizer, folder, self.fast_bpe)
        except Exception as exc:  # tokenizers raises plain Exception on bad files; a bad upload must not stop refresh
            log.warning("cannot load the tokenizer of %s from %s: %s", model, folder, exc)
            return
        self.tokenizer_dirs[model] = folder
        if self.on_tokenizer_ready:  # after its encoder check (its own thread), the hooks (the app's heap settle)
            self._side.add(task := asyncio.ensure_future(self._tokenizer_ready(model, tok)))
            task.add_done_callback(self._side.discard)

    async def _tokenizer_ready(self, model: str, tok) -> None:
        await asyncio.to_thread(tok.wait_fast, 120.0)
        for hook in self.on_tokenizer_ready:
            try:
                hook(model)
            except Exception:  # a hook's bug must not stop the pool
                log.exception("tokenizer-ready hook failed for %s", model)

    async def _scrape_one(self, live: LiveWorker) -> None:
        try:
            backend = get_backend(live.info.backend)
            status, body = await self._client.fetch("GET", live.info.url + backend.metrics_path, self.scrape_timeout_s)
            if status != 200:
                raise ValueError(f"HTTP {status} from {backend.metrics_path}")
            live.metrics = backend.parse_metrics(body.decode("utf-8", "replace"))
            live.scrape_errors = 0
        except (EngineUnreachableError, EngineStreamError, KeyError, ValueError) as exc:
            live.scrape_errors += 1
            wid = live.info.worker_id
            if live.scrape_errors == self.liveness_failures and self.workers.get(wid) is live:
                why = f"{live.scrape_errors} metric scrapes in a row failed (last: {type(exc).__name__}: {exc})"
                log.warning("worker %s is not answering: %s", wid, why)
                for hook in self.on_worker_unresponsive:
                    hook(wid, why)
            elif live.scrape_errors == 3:
                log.warning("cannot scrape %s: %s", wid, exc)

    def _start_scrapes(self) -> list[asyncio.Task]:
        """Start a scrape of each worker whose previous one has finished; the scrapes in flight."""
        for w in list(self.workers.values()):
            if w.scrape_task is None or w.scrape_task.done():
                w.scrape_task = asyncio.create_task(self._scrape_one(w))
        return [w.scrape_task for w in self.workers.values() if w.scrape_task is not None and not w.scrape_task.done()]

    async def scrape(self) -> None:
        """One round, awaited: every worker's scrape (started now, or already in flight) has ended on return."""
        tasks = self._start_scrapes()
        if tasks:
            await asyncio.wait(tasks)

    def models(self) -> list[str]:
        return sorted({w.info.model for w in self.workers.values()})

    def ready(self, model: str) -> list[LiveWorker]:
        return [w for w in self.workers.values() if w.info.model == model and w.info.state == WorkerState.READY]

    def endpoints(self, model: str, roles: tuple[str, ...] = ("both", "decode")) -> list[Endpoint]:
        """Ready endpoints of the model in the given roles; by default the ones that can serve a whole
        request (prefill-only workers take part only through orchestrator/disagg)."""
        out = []
        for w in self.ready(model):
            if w.info.role.value not in roles:
                continue
            m = w.metrics
            load = EndpointLoad(engine_waiting=m.num_requests_waiting, engine_kv_usage=m.kv_cache_usage) if m else EndpointLoad()
            out.append(Endpoint(worker_id=w.info.worker_id, url=w.info.url, model=model, block_size=w.info.block_size, role=w.info.role.value, load=load))
        return out

    def tokenizer_dir(self, model: str) -> str | None:
        return self.tokenizer_dirs.get(model)

    def info_for(self, model: str) -> WorkerInfo | None:
        """Any worker's registration for the model (its backend, P/D protocol, start time); the context
        length is `context_len`'s."""
        for w in self.workers.values():
            if w.info.model == model:
                return w.info
        return None

    def context_len(self, model: str) -> int | None:
        """The model's context length: the smallest max_model_len among its workers (every role), so a
        request checked against it fits whichever worker serves it. None if no worker is known."""
        lens = [w.info.max_model_len for w in self.workers.values() if w.info.model == model]
        return min(lens) if lens else None
