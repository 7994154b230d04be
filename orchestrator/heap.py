"""The cyclic garbage collector on the frontend's one event loop: its pauses measured, and the permanent heap kept out
of its full collections.

Every request, stream and engine call shares one loop, and a collection stops that loop for as long as it runs. Young
collections are short (the objects created since the last one). A full collection walks every tracked object the
process holds: the imports, the app, each model's tokenizer and its encoder's tables. benchmarks/gc_pauses.py
measures that walk at tens of ms with one tokenizer loaded, and at over 100 ms under load. None of
that heap ever becomes garbage, so it is moved out of the collector's reach with `gc.freeze()` (as the sim engine
does, workers/sim/__main__.py) once start-up is done and again once each tokenizer has loaded and been checked.
Each freeze is preceded by one full collection, so no garbage is frozen; objects made later are collected as
always. `frontend.gc_freeze: false` turns this off.

    GcPauses(histogram)   times every collection into `kvyard_gc_pause_seconds{generation}` (gc.callbacks)
    settle(reason)        gc.collect(), then gc.freeze(): what the process holds now is no longer walked
"""

from __future__ import annotations

import gc
import logging
import time

__all__ = ["GcPauses", "settle"]

log = logging.getLogger("kvyard.frontend")


class GcPauses:
    """Observes each garbage collection's duration, by generation, into `histogram` (labelled `generation`)."""

    def __init__(self, histogram) -> None:
        self._children = [histogram.labels(str(g)) for g in range(3)]
        self._started = 0.0
        self._installed = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            g = info.get("generation", 2)
            self._children[g if 0 <= g <= 2 else 2].observe(time.perf_counter() - self._started)

    def start(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True

    def stop(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False


def settle(reason: str) -> float:
    """One full collection, then freeze what survives; returns the collection's seconds (logged)."""
    t = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - t
    gc.freeze()
    log.info("heap settled after %s: %d objects frozen (full collection %.0f ms)", reason, gc.get_freeze_count(), took * 1000)
    return took
