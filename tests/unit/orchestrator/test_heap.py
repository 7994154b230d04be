"""orchestrator/heap.py: every collection's pause is observed by generation; settling freezes what the process holds,
so a full collection no longer walks it; the pool tells when a tokenizer is loaded and checked; only an app that owns
its process settles the heap."""

from __future__ import annotations

import asyncio
import gc

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Histogram

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from orchestrator.heap import GcPauses, settle
from orchestrator.pool import WorkerPool
from router import Router
from workers.discovery import InMemoryDiscovery
from workers.sim.backend import SIM_TOKENIZER_DIR
from workers.types import WorkerInfo


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # the test process keeps collecting everything


def _count(h: Histogram, gen: str) -> float:
    return next(s.value for m in h.collect() for s in m.samples if s.name.endswith("_count") and s.labels["generation"] == gen)


def test_each_collection_is_observed_by_generation():
    h = Histogram("gc_pause", "x", ["generation"], registry=CollectorRegistry())
    watch = GcPauses(h)
    watch.start()
    watch.start()  # once only
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        watch.stop()
    assert _count(h, "0") >= 1 and _count(h, "2") == 1
    gc.collect(2)
    assert _count(h, "2") == 1  # stopped: no more observations


def test_settle_takes_the_heap_out_of_full_collections(unfrozen):
    keep = [{"i": i} for i in range(20000)]  # long-lived containers the collector would walk
    before = len(gc.get_objects())
    settle("a test")
    assert gc.get_freeze_count() >= len(keep) and len(gc.get_objects()) < before - len(keep)
    assert keep[0]["i"] == 0


async def test_the_pool_says_when_a_tokenizer_is_loaded_and_checked():
    disc = InMemoryDiscovery()
    await disc.register(WorkerInfo(worker_id="w0", model="m", backend="sim", url="http://127.0.0.1:9",
                                   tokenizer=str(SIM_TOKENIZER_DIR)), 60)
    pool = WorkerPool(disc, Router("kv"), liveness_failures=0)
    ready: list[str] = []
    pool.on_tokenizer_ready.append(ready.append)
    pool.on_tokenizer_ready.append(lambda model: 1 / 0)  # a broken hook is logged, not raised
    try:
        await pool.refresh()
        assert pool.tokenizer_dirs["m"] == str(SIM_TOKENIZER_DIR)
        for _ in range(300):
            if ready:
                break
            await asyncio.sleep(0.05)
        assert ready == ["m"]
    finally:
        await pool.close()


@pytest.mark.parametrize("owns, freeze, settled", [(True, True, True), (True, False, False), (False, True, False)])
def test_only_a_process_owning_app_settles_its_heap(unfrozen, owns, freeze, settled):
    app = create_app(FrontendConfig(gc_freeze=freeze), InMemoryDiscovery(), owns_process=owns)
    with TestClient(app) as client:
        assert client.get("/live").status_code == 200
        assert (gc.get_freeze_count() > 0) == settled
        assert "kvyard_gc_pause_seconds" in client.get("/metrics").text
