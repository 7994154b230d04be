"""Request and endpoint types the router works on. Plain data; no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["RouteRequest", "Endpoint", "EndpointLoad", "RoutingDecision"]


@dataclass(slots=True)
class RouteRequest:
    """One request as the router sees it (built by the frontend after tokenizing)."""

    request_id: str
    model: str
    # the prompt's ids, or its first ones (see prompt_tokens): a list, or for a long prompt a uint32 array
    # (orchestrator/token_cache.py); a plugin reads it as a sequence of ints
    token_ids: Sequence[int] = field(default_factory=list)
    max_tokens: int = 0
    lora_name: str | None = None  # a LoRA adapter's name: seeds the block hashes (router/hashing.py)
    session_id: str | None = None  # a client's conversation id (x-session-id): read by session affinity
    # multimodal items in the prompt: (identifier, offset, length) of each item's placeholder tokens, by offset
    # (router/mm_hashing.py mixes them into the hashes of the blocks they cover)
    mm_items: tuple[tuple[str, int, int], ...] = ()
    # Filled by Router.route when the policy has a KV index (read by scorers, never written by them):
    block_hashes: Sequence[int] | None = None  # chained hashes of the full blocks (router/hashing.py)
    hashed_block_size: int = 0  # the block size block_hashes were computed for
    overlap_blocks: dict[str, int] = field(default_factory=dict)  # worker_id -> cached prefix blocks
    # the prompt's token count when token_ids holds only its first tokens (an estimate until the engine's usage
    # says; orchestrator/prepare.py tokenizes a long prompt only as far as routing needs); -1: len(token_ids)
    prompt_tokens: int = -1

    @property
    def isl(self) -> int:
        return self.prompt_tokens if self.prompt_tokens >= 0 else len(self.token_ids)


@dataclass(slots=True)
class EndpointLoad:
    """Predicted load on one endpoint: the router's own bookkeeping plus the last engine scrape."""

    inflight_requests: int = 0
    prefill_tokens: int = 0  # prompt tokens routed here whose first token has not come back yet
    active_blocks: int = 0  # KV blocks held by requests in flight here (prompt + generated so far)
    engine_waiting: float = 0.0  # vllm:num_requests_waiting at the last scrape
    engine_kv_usage: float = 0.0  # 0..1 at the last scrape


@dataclass(slots=True)
class Endpoint:
    """A routable engine: identity from the registry, load from the router."""

    worker_id: str
    url: str
    model: str
    block_size: int = 16
    role: str = "both"
    load: EndpointLoad = field(default_factory=EndpointLoad)
    adapters: frozenset[str] = frozenset()  # LoRA adapters loaded on the engine (set by the frontend when it knows)


class RoutingDecision:
    """Endpoints ranked best first; the caller tries them in order (failover without asking again).

    `scores` (worker_id -> summed score) is built on first access: the kv policy's fast path hands over its scores
    as packed doubles in endpoint order (`packed=(endpoints, bytes)`), so a decision nobody inspects costs no
    dict."""

    __slots__ = ("ranked", "policy", "overlap_blocks", "_scores", "_packed")

    def __init__(self, ranked: list[Endpoint], scores: dict[str, float] | None = None, policy: str = "",
                 overlap_blocks: dict[str, int] | None = None, packed: tuple[list[Endpoint], bytes] | None = None) -> None:
        self.ranked = ranked
        self.policy = policy
        self.overlap_blocks = {} if overlap_blocks is None else overlap_blocks  # worker_id -> cached prefix blocks
        self._scores = scores
        self._packed = packed

    @property
    def scores(self) -> dict[str, float]:
        if self._scores is None:
            if self._packed is None:
                self._scores = {}
            else:
                endpoints, raw = self._packed
                self._scores = dict(zip([ep.worker_id for ep in endpoints], memoryview(raw).cast("d").tolist()))
        return self._scores

    @property
    def best(self) -> Endpoint:
        return self.ranked[0]

    def overlap_of(self, endpoint: Endpoint) -> int:
        """Prompt blocks already cached on `endpoint` (0 when the policy keeps no KV index)."""
        return self.overlap_blocks.get(endpoint.worker_id, 0)

    def __repr__(self) -> str:
        return (f"RoutingDecision(ranked={[ep.worker_id for ep in self.ranked]}, policy={self.policy!r}, "
                f"overlap_blocks={self.overlap_blocks})")
