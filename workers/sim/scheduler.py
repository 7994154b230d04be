"""Continuous-batching scheduler, the vLLM v1 way (`vllm/v1/core/sched/scheduler.py`, FCFS policy).

One `schedule()` call plans one engine step under a token budget `max_num_batched_tokens`:
1. Running requests first, in order: each asks for `num_tokens - num_computed_tokens` tokens (1 for a
   decode, the rest of its prompt for an unfinished chunked prefill), capped by the remaining budget
   and by `max_model_len - 1 - num_computed_tokens`. If its blocks cannot be allocated, the *last*
   running request is preempted (recompute: blocks freed, `num_computed_tokens = 0`, pushed to the
   front of the waiting queue) and allocation is retried; if the victim is the request itself, the
   running pass stops.
2. Then, only if nothing was preempted this step, waiting requests in FCFS order while budget is
   left and fewer than `max_num_seqs` run: a request starting from zero looks up its prefix-cache hit
   (the hit tokens are skipped), takes `min(remaining, budget)` tokens (chunked prefill) and is
   admitted only if its *whole* sequence fits in the free blocks now (vLLM 0.32's default
   `scheduler_reserve_full_isl`) and the chunk's blocks are allocated; otherwise the waiting pass
   stops (head-of-line).
3. `num_computed_tokens` advances at schedule time. `update_from_output()` then samples one token for
   every scheduled request that reached the end of its known tokens, applies the stop checks
   (`max_tokens`, `max_model_len`, `stop_token_ids`) and frees finished requests' blocks.

Prefix-cache counters (`queries`/`hits`, in tokens) count each request once, on its first admission,
like vLLM's Prometheus counters (re-admissions after preemption are not counted). Pure, synchronous.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.sim.hashing import BlockHasher
from workers.sim.kv_manager import KvBlockManager

__all__ = ["RequestStatus", "SimRequest", "StepPlan", "StepResult", "Scheduler"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


def _zero_token(_k: int) -> int:
    return 0


@dataclass(eq=False, slots=True)
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    #: output token id for output position k (deterministic text source)
    token_source: Callable[[int], int] = _zero_token
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    all_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class StepPlan:
    """One planned step: who runs with how many tokens, and what the timing model needs."""

    scheduled: list[tuple[SimRequest, int]] = field(default_factory=list)
    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)  # (computed before, new)
    decode_contexts: list[int] = field(default_factory=list)
    newly_admitted: list[SimRequest] = field(default_factory=list)  # first admission (not resumes)
    starts_prefill: bool = False  # some request is scheduled from the waiting queue (incl. resumes)
    preempted: list[SimRequest] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass(slots=True)
class StepResult:
    """What one step produced: (request, its new token ids) and the requests that finished."""

    outputs: list[tuple[SimRequest, list[int]]] = field(default_factory=list)
    finished: list[SimRequest] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        kv: KvBlockManager,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int = 8192,
        hasher: BlockHasher | None = None,
    ) -> None:
        self.kv = kv
        self.hasher = hasher or BlockHasher(kv.block_size)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_preemptions = 0

    # ---- intake --------------------------------------------------------------------------------
    def add_request(self, req: SimRequest) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if not req.all_token_ids:
            req.all_token_ids = list(req.prompt_token_ids)
        self.hasher.extend(req.block_hashes, req.all_token_ids)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str, reason: str = "abort") -> SimRequest | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = req.finish_reason or reason
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        kv = self.kv
        i = 0
        running = self.running
        limit = self.max_model_len - 1
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            n = min(len(req.all_token_ids) - computed, budget, limit - computed)
            if n <= 0:
                i += 1
                continue
            scheduled = True
            while not kv.allocate_slots(req.request_id, req.all_token_ids, req.block_hashes, computed, n, (), self.max_model_len):
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            self._plan(plan, req, n)
            budget -= n
            i += 1

        if not plan.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                hit_blocks: list[int] = []
                if req.num_computed_tokens == 0:
                    hit_blocks, hit_tokens = kv.get_computed_blocks(req.block_hashes, req.num_tokens)
                else:  # pragma: no cover - waiting requests always restart from zero here
                    hit_tokens = 0
                n = min(req.num_tokens - hit_tokens, budget)
                if not kv.can_fit(req.request_id, min(req.num_tokens, self.max_model_len), hit_blocks):
                    break  # the whole sequence must fit before admission (scheduler_reserve_full_isl)
                if not kv.allocate_slots(
                    req.request_id, req.all_token_ids, req.block_hashes, hit_tokens, n, hit_blocks, self.max_model_len
                ):
                    break
                self.waiting.popleft()
                if req.status is RequestStatus.WAITING:
                    self.prefix_queries += req.num_tokens
                    self.prefix_hits += hit_tokens
                    req.num_cached_tokens = hit_tokens
                    plan.newly_admitted.append(req)
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = hit_tokens
                plan.starts_prefill = True
                self.running.append(req)
                self._plan(plan, req, n)
                budget -= n
        return plan

    def _plan(self, plan: StepPlan, req: SimRequest, n: int) -> None:
        p = req.num_computed_tokens
        if n == 1 and req.output_token_ids and p + 1 == len(req.all_token_ids):
            plan.decode_contexts.append(p + 1)
        else:
            plan.prefill_chunks.append((p, n))
        plan.scheduled.append((req, n))
        req.num_computed_tokens = p + n

    def _preempt(self, req: SimRequest) -> None:
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(self, plan: StepPlan) -> StepResult:
        """Apply a finished step: sample tokens, run stop checks, free finished requests."""
        result = StepResult()
        outputs = result.outputs
        running = RequestStatus.RUNNING
        bs, max_len = self.hasher.block_size, self.max_model_len
        for req, _n in plan.scheduled:
            all_ids = req.all_token_ids
            if req.status is not running or req.num_computed_tokens < len(all_ids):
                continue  # aborted meanwhile, or a partial prefill chunk (no token sampled)
            out_ids = req.output_token_ids
            tok = req.token_source(len(out_ids))
            out_ids.append(tok)
            all_ids.append(tok)
            if len(all_ids) % bs == 0:
                self.hasher.extend(req.block_hashes, all_ids)
            outputs.append((req, [tok]))
            if req.stop_token_ids and tok in req.stop_token_ids and len(out_ids) >= req.min_tokens:
                req.finish_reason, req.stop_reason = "stop", tok
            elif len(out_ids) >= req.max_tokens or len(all_ids) >= max_len:
                req.finish_reason = "length"
            if req.finish_reason is not None:
                self._finish(req)
                result.finished.append(req)
        return result

    def _finish(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.requests.pop(req.request_id, None)
        self.kv.free(req.request_id)
        req.status = RequestStatus.FINISHED
