"""The router's settings: which policy, and each policy's own parameters (the one place their defaults live).

The frontend's config tree (orchestrator/config) holds a `RouterConfig` under `frontend.router`; `build_policy`
and the kv scorer take their defaults from here, so the library and the served default never disagree.
How the kv cost uses each weight: router/plugins/kv.py and docs/routing.md.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["KvPolicyConfig", "RouterConfig", "PolicyName", "KV_DEFAULTS"]

PolicyName = Literal["kv", "least-loaded", "round-robin", "random"]


class KvPolicyConfig(BaseModel):
    """The kv policy: cached prefix against load (router/plugins/kv.py). Dynamo's cost is weights 1 / 1 / 0."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    overlap_weight: float = Field(16.0, ge=0, description="weight of uncached prefill blocks against decode blocks")
    reuse_weight: float = Field(8.0, ge=0, description="queued prefill tokens one cached prompt token is worth (1: TTFT-greedy)")
    request_weight: float = Field(16.0, ge=0, description="blocks of decode load each request in flight costs beyond its own")
    pending_ttl_s: float = Field(10.0, ge=0, description="seconds a routed request's new blocks count as cached before "
                                                        "events confirm them (0: events only)")
    prefill_drain: bool = Field(True, description="drain booked prefill at each worker's measured prefill rate")
    temperature: float = Field(0.0, ge=0, description="0: lowest cost wins; > 0: softmax sampling over the costs")


KV_DEFAULTS = KvPolicyConfig()


class RouterConfig(BaseModel):
    """Which policy routes requests, and the parameters of the policies that take any."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: PolicyName = Field("kv", description="kv, least-loaded, round-robin or random")
    kv: KvPolicyConfig = Field(default_factory=KvPolicyConfig, description="the kv policy's parameters")

    def policy_params(self) -> dict:
        """Keyword arguments of `build_policy(self.policy, ...)`."""
        if self.policy != "kv":
            return {}
        k = self.kv
        return {"overlap_weight": k.overlap_weight, "reuse_weight": k.reuse_weight, "request_weight": k.request_weight,
                "pending_ttl_s": k.pending_ttl_s, "temperature": k.temperature}
