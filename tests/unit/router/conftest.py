"""Shared helpers for the router tests: both kernel implementations, vLLM golden captures, endpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from router import _kernels, hashing, kv_index
from router.plugins import kv as kv_plugin

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm"


@pytest.fixture(params=["c", "python"])
def impl(request, monkeypatch) -> str:
    """Run a test once on the C kernels and once on their pure-Python twins."""
    if request.param == "c":
        if _kernels.IMPLEMENTATION != "c" or hashing.IMPLEMENTATION != "c":
            pytest.skip("router._kvcore is not built")
        return "c"
    monkeypatch.setattr(hashing, "_chain_hashes", hashing.py_chain_hashes)
    monkeypatch.setattr(kv_index, "MaskTable", _kernels.PyMaskTable)
    monkeypatch.setattr(kv_plugin, "kv_scores", _kernels.py_kv_scores)
    monkeypatch.setattr(_kernels, "rank_by_score", _kernels.py_rank_by_score)
    monkeypatch.setattr(_kernels, "kv_rank", _kernels.py_kv_rank)
    monkeypatch.setattr(_kernels, "merge_loads", _kernels.py_merge_loads)
    return "python"


@pytest.fixture(scope="session")
def kv_golden() -> dict[str, Any]:
    return json.loads((FIXTURES / "kv_events.json").read_text())


@pytest.fixture(scope="session")
def legacy_golden() -> dict[str, Any]:
    return json.loads((FIXTURES / "kv_legacy_batch.json").read_text())


def frames(msg: list[str]) -> list[bytes]:
    return [bytes.fromhex(f) for f in msg]


def assert_consistent(ix) -> None:
    """The index's invariants: the owner table is exactly what the per-worker maps say."""
    from collections import Counter

    expected: dict[int, int] = {}
    for w in ix._workers.values():
        counts = Counter(w.blocks.values())
        for h, c in counts.items():
            assert w.extra.get(h, 0) == c - 1, f"{w.worker_id}: refcount of {h}"
        assert set(w.extra) <= set(counts), f"{w.worker_id}: extra refs for hashes it does not hold"
        held = set(counts) | (w.predicted.all() if w.predicted is not None else set())
        for h in held:
            expected[h] = expected.get(h, 0) | (1 << w.slot)
    assert len(ix._owners) == len(expected)
    for h, mask in expected.items():
        assert ix._owners.get(h) == mask, f"owners of {h}"
    pending: dict[int, int] = {}  # the pending table: only bits of live predictions (a dropped one may have
    for w in ix._workers.values():  # cleared blocks a younger one shares), and all of the newest's of each worker
        for _, hashes in w.pending:
            for h in hashes:
                pending[h] = pending.get(h, 0) | (1 << w.slot)
        if w.pending:
            assert all(ix._pending.get(h) & (1 << w.slot) for h in w.pending[-1][1]), f"{w.worker_id}: newest prediction"
    assert len(ix._pending) <= len(pending)
    for h, mask in pending.items():
        assert ix._pending.get(h) & ~mask == 0, f"pending owners of {h}"
