"""Hot loops of the router: C (router._kvcore) when built, else these identical Python twins.

    MaskTable        our block hash -> bitmask of worker slots (bit = 1 << slot)
      add(keys, slot) -> keys that already had the slot's bit      (mask |= bit)
      remove(keys, slot)                                            (mask &= ~bit; 0 -> deleted)
      get(key) -> mask (0 when absent);  len(table) -> entries;  nbytes -> memory held
      match(keys, also=None) -> [(depth, mask), ...]
          mask(key) = the table's mask | also's (another MaskTable, e.g. pending predictions), then
          active = mask(keys[0]); for k >= 1: kept = mask(keys[k]) & active; where kept != active
          the workers in active & ~kept matched exactly k blocks -> (k, active & ~kept); stop when
          nothing is active; workers active after the last key matched all: (len(keys), active).
    kv_scores(endpoints, overlaps, isl, hashed_block_size, overlap_weight, reuse_weight=1.0, request_weight=0.0) -> {worker_id: score}
          the kv cost scorer (formula in router/plugins/kv.py), bit-identical floats in both.
    rank_by_score(scores, endpoints, r) -> endpoints, highest score first (missing: 0.0), ties in
          input order, except that the leaders tied for first are rotated by r % their count.
    kv_rank(endpoints, overlaps, isl, hashed_block_size, overlap_weight, reuse_weight, request_weight, r)
          -> (rank_by_score(kv_scores(...), endpoints, r), the scores as bytes of native doubles in endpoint
          order): the default kv policy's score and rank in one pass, with no float or dict per endpoint.
    merge_loads(endpoints, own_loads) -> None: for each endpoint with an entry in own_loads, copy
          the scraped engine fields into that entry and make it the endpoint's load.

The C table stores keys and masks inline (16 bytes per entry for up to 64 workers, 3/4 full at
most), where a dict of Python ints costs ~10x the memory and 4 cache misses per lookup.
"""

from __future__ import annotations

import sys
from array import array

__all__ = ["IMPLEMENTATION", "MaskTable", "PyMaskTable", "kv_rank", "kv_scores", "merge_loads", "py_kv_logits", "py_kv_rank", "py_kv_scores",
           "py_merge_loads", "py_rank_by_score", "rank_by_score"]


class PyMaskTable:
    def __init__(self) -> None:
        self._d: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._d)

    @property
    def nbytes(self) -> int:
        return sys.getsizeof(self._d) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in self._d.items())

    def get(self, key: int) -> int:
        return self._d.get(key, 0)

    def add(self, keys, slot: int) -> list[int]:
        d = self._d
        bit = 1 << slot
        had = []
        for k in keys:
            m = d.get(k, 0)
            if m & bit:
                had.append(k)
            else:
                d[k] = m | bit
        return had

    def remove(self, keys, slot: int) -> None:
        d = self._d
        inv = ~(1 << slot)
        for k in keys:
            m = d.get(k)
            if m is None:
                continue
            rest = m & inv
            if rest:
                d[k] = rest
            else:
                del d[k]

    def match(self, keys, also: "PyMaskTable | None" = None) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        if not keys:
            return out
        if also is not None and len(also):
            own, other = self._d.get, also._d.get

            def get(k, default=0):
                return own(k, 0) | other(k, 0)
        else:
            get = self._d.get
        active = get(keys[0], 0)
        for k in range(1, len(keys)):
            if not active:
                return out
            kept = get(keys[k], 0) & active
            if kept != active:
                out.append((k, active & ~kept))
                active = kept
        if active:
            out.append((len(keys), active))
        return out


def py_kv_logits(endpoints, overlaps: dict[str, int], isl: int, hashed_block_size: int, overlap_weight: float,
                 reuse_weight: float = 1.0, request_weight: float = 0.0) -> list[float]:
    """logit(w) per endpoint, in endpoint order (lower is better): the cost of router/plugins/kv.py."""
    logits = []
    for ep in endpoints:
        bs = ep.block_size
        if bs <= 0:
            raise ValueError("endpoint block_size must be positive")
        ov = overlaps.get(ep.worker_id, 0) if overlaps and bs == hashed_block_size else 0
        ld = ep.load
        pf = ld.prefill_tokens
        credit = (reuse_weight - 1.0) * (ov * bs)
        pfe = pf - credit
        if credit > 0 and pfe < 0:
            pfe = pf if pf < 0 else 0.0
        logit = overlap_weight * ((isl - ov * bs) + pfe) / bs + (-(-isl // bs) - ov + ld.active_blocks)
        if request_weight != 0.0:
            logit += request_weight * ld.inflight_requests
        logits.append(logit)
    return logits


def py_kv_scores(endpoints, overlaps: dict[str, int], isl: int, hashed_block_size: int, overlap_weight: float,
                 reuse_weight: float = 1.0, request_weight: float = 0.0) -> dict[str, float]:
    logits = py_kv_logits(endpoints, overlaps, isl, hashed_block_size, overlap_weight, reuse_weight, request_weight)
    hi = max(logits)
    span = hi - min(logits)
    wids = [ep.worker_id for ep in endpoints]
    if span <= 0:
        return dict.fromkeys(wids, 1.0)
    inv = 1.0 / span
    return dict(zip(wids, [(hi - x) * inv for x in logits]))


def py_rank_by_score(scores: dict[str, float], endpoints: list, r: int) -> list:
    get = scores.get
    vals = [get(ep.worker_id, 0.0) for ep in endpoints]
    order = sorted(range(len(vals)), key=vals.__getitem__, reverse=True)  # stable: ties keep input order
    ties = vals.count(vals[order[0]]) if order else 0
    if ties > 1:
        rot = r % ties
        order[:ties] = order[rot:ties] + order[:rot]
    return [endpoints[i] for i in order]


def py_kv_rank(endpoints, overlaps: dict[str, int], isl: int, hashed_block_size: int, overlap_weight: float, reuse_weight: float,
               request_weight: float, r: int) -> tuple[list, bytes]:
    if not endpoints:
        return [], b""
    scores = py_kv_scores(endpoints, overlaps, isl, hashed_block_size, overlap_weight, reuse_weight, request_weight)
    return py_rank_by_score(scores, endpoints, r), array("d", [scores[ep.worker_id] for ep in endpoints]).tobytes()


def py_merge_loads(endpoints: list, own_loads: dict) -> None:
    get = own_loads.get
    for ep in endpoints:
        own = get(ep.worker_id)
        if own is None or own is ep.load:  # nothing booked yet (own counters 0), or merged already
            continue
        scraped = ep.load
        own.engine_waiting = scraped.engine_waiting
        own.engine_kv_usage = scraped.engine_kv_usage
        ep.load = own


try:
    from router._kvcore import MaskTable, kv_rank, kv_scores, merge_loads, rank_by_score

    IMPLEMENTATION = "c"
except ImportError:
    MaskTable, kv_scores, rank_by_score, merge_loads = PyMaskTable, py_kv_scores, py_rank_by_score, py_merge_loads  # type: ignore[misc]
    kv_rank = py_kv_rank
    IMPLEMENTATION = "python"
