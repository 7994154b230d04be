"""The frontend's routers, built in one place from its config: what `create_app` serves with and what
`kvyard replay` (orchestrator/replay/) routes with, so both run the same policy objects.

    build_router(cfg)            the service's router: cfg.router's policy and parameters, pending predictions,
                                 prefill drain, and the stages (LoRA adapter holders, session affinity)
    build_phase_routers(...)     P/D: (decode router, prefill router) over the service router's prefix index;
                                 decode shares the service's load book, prefill keeps its own

`clock` is the time source of the load books and the prefix index's pending predictions (time.monotonic when
serving; the replay's virtual clock).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from orchestrator.config import DisaggConfig, FrontendConfig
from orchestrator.sessions import build_affinity
from router import KvIndex, LoadTracker, Router, build_policy
from router.config import KvPolicyConfig
from router.plugins import AdapterAffinity

__all__ = ["build_phase_routers", "build_router", "make_stages"]


def make_stages(cfg: FrontendConfig) -> list:
    """The router's stages, in order: LoRA adapter holders first, then the session's worker (router/interfaces.py)."""
    stages: list = [AdapterAffinity(cfg.lora.max_load_gap)] if cfg.lora.adapters else []
    affinity = build_affinity(cfg.affinity)
    return stages + ([affinity] if affinity is not None else [])


def build_router(cfg: FrontendConfig, clock: Callable[[], float] = time.monotonic, seed: int | None = None) -> Router:
    """`seed` fixes the picker's random tie-breaks (the replay's, so a run can be repeated); None when serving."""
    rcfg = cfg.router
    params: dict = rcfg.policy_params() | ({} if seed is None else {"seed": seed})
    if rcfg.policy == "kv":
        params.pop("pending_ttl_s")
        params["index"] = KvIndex(pending_ttl_s=rcfg.kv.pending_ttl_s, clock=clock)
    return Router(build_policy(rcfg.policy, **params), LoadTracker(drain=rcfg.kv.prefill_drain, clock=clock),
                  stages=make_stages(cfg))


def build_phase_routers(cfg: DisaggConfig, router: Router, kv: KvPolicyConfig, clock: Callable[[], float] = time.monotonic,
                        seed: int | None = None) -> tuple[Router, Router]:
    """(decode router, prefill router) of a disaggregated model, both on `router`'s prefix index. Decode weighs load
    against the blocks it holds (Dynamo's decode cost, prefill weight cfg.decode_overlap_weight) on `router`'s load
    book; prefill is the kv cost with its own reuse credit (cfg.prefill_reuse_weight, else kv's). Neither prices
    requests in flight (request weight 0): both pools' costs were measured without that term."""
    index = router.kv_index  # None (a policy without one): each phase predicts its own, from its routing alone
    decode = Router(build_policy("kv", overlap_weight=cfg.decode_overlap_weight, reuse_weight=1.0, request_weight=0.0,
                                 index=index or KvIndex(clock=clock), seed=seed), load=router.loads)
    reuse = kv.reuse_weight if cfg.prefill_reuse_weight is None else cfg.prefill_reuse_weight
    prefill = Router(build_policy("kv", overlap_weight=kv.overlap_weight, reuse_weight=reuse, request_weight=0.0,
                                  index=index or KvIndex(clock=clock), seed=None if seed is None else seed + 1),
                     load=LoadTracker(clock=clock))
    return decode, prefill
