"""The frontend's routers, built in one place from its config: what `create_app` serves with and what
`kvyard replay` (orchestrator/replay/) routes with, so both run the same policy objects.

    build_router(cfg)            the service's router: cfg.policy with the kv cost's weights, pending
                                 predictions and prefill drain (orchestrator/config.py says why each default)
    build_phase_routers(...)     P/D: (decode router, prefill router) over the service router's prefix index;
                                 decode shares the service's load book, prefill keeps its own

`clock` is the time source of the load books and the prefix index's pending predictions (time.monotonic when
serving; the replay's virtual clock).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from orchestrator.config import DisaggConfig, FrontendConfig
from router import KvIndex, LoadTracker, Router, build_policy

__all__ = ["build_phase_routers", "build_router"]


def build_router(cfg: FrontendConfig, clock: Callable[[], float] = time.monotonic, seed: int | None = None) -> Router:
    """`seed` fixes the picker's random tie-breaks (the replay's, so a run can be repeated); None when serving."""
    params: dict = {} if seed is None else {"seed": seed}
    if cfg.policy == "kv":
        params |= {"overlap_weight": cfg.kv_overlap_weight, "reuse_weight": cfg.kv_reuse_weight,
                  "request_weight": cfg.kv_request_weight, "temperature": cfg.router_temperature,
                  "index": KvIndex(pending_ttl_s=cfg.kv_pending_ttl_s, clock=clock)}
    return Router(build_policy(cfg.policy, **params), LoadTracker(drain=cfg.kv_prefill_drain, clock=clock))


def build_phase_routers(cfg: DisaggConfig, router: Router, prefill_overlap_weight: float = 1.0,
                        prefill_reuse_weight: float = 1.0, clock: Callable[[], float] = time.monotonic,
                        seed: int | None = None) -> tuple[Router, Router]:
    """(decode router, prefill router) of a disaggregated model: both on `router`'s prefix index; decode with
    Dynamo's prefill weight (cfg.decode_overlap_weight, 0 by default) and `router`'s load book."""
    index = router.kv_index  # None (a policy without one): each phase predicts its own, from its routing alone
    decode = Router(build_policy("kv", overlap_weight=cfg.decode_overlap_weight, index=index or KvIndex(clock=clock), seed=seed),
                    load=router.loads)
    prefill = Router(build_policy("kv", overlap_weight=prefill_overlap_weight, reuse_weight=prefill_reuse_weight,
                                  index=index or KvIndex(clock=clock), seed=None if seed is None else seed + 1),
                     load=LoadTracker(clock=clock))
    return decode, prefill
