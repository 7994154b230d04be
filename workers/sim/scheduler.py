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
like vLLM's Prometheus counters (re-admissions after preemption are not counted).

P/D disaggregation (workers/sim/disagg.py), the vLLM v1 connector way:
- A prefill request with `hold_blocks` keeps its blocks when it finishes (`held`, like a connector's
  delayed free) until `release_held()`.
- A decode request with `remote` KV is admitted like any other (whole sequence must fit, local prefix
  hit looked up), but its blocks are allocated *uncached* and it stays in the waiting queue, not
  scheduled and using no token budget (vLLM's WAITING_FOR_REMOTE_KVS; `plan.remote_loads` tells the
  engine to start the pull). `finish_remote_load()` then caches the blocks (BlockStored) and leaves
  the last prompt token to compute (`num_computed_tokens = prompt - 1`, as vLLM does to get logits),
  which is planned as a decode step; a failed load either recomputes locally from the prefix hit or
  ends the request with finish_reason "error" (`kv_load_failure_policy`). Pure, synchronous.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
    hold_blocks: bool = False  # prefill for a remote decode: keep the blocks at finish
    remote: Any = None  # decode: where the prompt KV comes from (disagg.RemoteSource)
    kv_load: str | None = None  # None | "loading" (pull in flight) | "ready" (blocks allocated, schedulable)
    kv_loaded: bool = False  # the prompt KV arrived: only the last prompt token is left (a decode step)
    num_external_tokens: int = 0  # prompt tokens that came from the remote prefill
    tag: Any = None  # whatever the engine's driver attaches (the replay: the request's record); never read here

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
    remote_loads: list[tuple[SimRequest, int]] = field(default_factory=list)  # (decode admitted, local hit tokens)
    prefills_done: int = 0  # prefill chunks that finish their request's known tokens (a token is sampled after them)
    prefills_done_tokens: int = 0  # the context lengths of those requests, summed

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
        self.held: dict[str, SimRequest] = {}  # finished prefills whose blocks a remote decode will read
        self.num_loading = 0  # waiting requests whose prompt KV is being pulled
        self.external_tokens = 0  # prompt tokens that arrived from remote prefills (vLLM: external_kv_transfer)

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
            if req.kv_load == "loading":
                self.num_loading -= 1
        self.kv.free(request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = req.finish_reason or reason
        return req

    def release_held(self, request_id: str) -> bool:
        """Free a finished prefill's held blocks (read by the decode, expired, or abandoned)."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.kv.free(request_id)
        return True

    def finish_remote_load(self, request_id: str, ok: bool, recompute: bool = False) -> SimRequest | None:
        """A decode's pull ended. ok: cache the arrived blocks, leave the last prompt token to compute.
        Failed: recompute locally (`recompute`) or end the request (returned, finish_reason "error")."""
        req = self.requests.get(request_id)
        if req is None or req.kv_load != "loading":
            return None
        self.num_loading -= 1
        if ok:
            n = req.num_tokens
            self.kv.cache_blocks(request_id, req.all_token_ids, req.block_hashes, n)
            req.num_external_tokens = n - req.num_computed_tokens
            self.external_tokens += req.num_external_tokens
            req.num_computed_tokens = n - 1
            req.kv_loaded = True
            req.kv_load = "ready"
            return None
        if recompute:  # num_computed_tokens stays at the local prefix hit; the rest is prefilled here
            req.kv_load = "ready"
            return None
        self.waiting.remove(req)
        self.requests.pop(request_id, None)
        self.kv.free(request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = "error"
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > self.num_loading

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        kv = self.kv
        i = 0
        running = self.running
        limit = self.max_model_len - 1
        max_len = self.max_model_len
        allocate = kv.allocate_slots
        decode_contexts, scheduled_list = plan.decode_contexts, plan.scheduled
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            all_ids = req.all_token_ids
            total = len(all_ids)
            n = min(total - computed, budget, limit - computed)
            if n <= 0:
                i += 1
                continue
            scheduled = True
            while not allocate(req.request_id, all_ids, req.block_hashes, computed, n, (), max_len):
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            if n == 1 and computed + 1 == total and (req.output_token_ids or req.kv_loaded):  # a decode: _plan, inlined
                decode_contexts.append(total)
                scheduled_list.append((req, 1))
                req.num_computed_tokens = total
            else:
                self._plan(plan, req, n)
            budget -= n
            i += 1

        if not plan.preempted:
            waiting = self.waiting
            i = 0  # requests before i are waiting for their remote KV (skipped, as vLLM skips them)
            while i < len(waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
                req = waiting[i]
                if req.kv_load is not None:
                    if req.kv_load == "loading":
                        i += 1
                        continue
                    computed = req.num_computed_tokens  # "ready": blocks allocated at admission
                    n = min(req.num_tokens - computed, budget)
                    if not kv.allocate_slots(req.request_id, req.all_token_ids, req.block_hashes, computed, n, (), self.max_model_len):
                        break
                    del waiting[i]
                    req.kv_load = None
                    req.status = RequestStatus.RUNNING
                    plan.starts_prefill = plan.starts_prefill or not req.kv_loaded
                    self.running.append(req)
                    self._plan(plan, req, n)
                    budget -= n
                    continue
                hit_blocks: list[int] = []
                if req.num_computed_tokens == 0:
                    hit_blocks, hit_tokens = kv.get_computed_blocks(req.block_hashes, req.num_tokens)
                else:  # pragma: no cover - waiting requests always restart from zero here
                    hit_tokens = 0
                if not kv.can_fit(req.request_id, min(req.num_tokens, self.max_model_len), hit_blocks):
                    break  # the whole sequence must fit before admission (scheduler_reserve_full_isl)
                if req.remote is not None and req.status is RequestStatus.WAITING:
                    # a remote decode: allocate the whole prompt now, uncached until its KV arrives
                    if not kv.allocate_slots(req.request_id, req.all_token_ids, req.block_hashes, hit_tokens,
                                             req.num_tokens - hit_tokens, hit_blocks, self.max_model_len, cache=False):
                        break
                    self.prefix_queries += req.num_tokens
                    self.prefix_hits += hit_tokens
                    req.num_cached_tokens = hit_tokens
                    req.num_computed_tokens = hit_tokens
                    req.kv_load = "loading"
                    self.num_loading += 1
                    plan.newly_admitted.append(req)
                    plan.remote_loads.append((req, hit_tokens))
                    i += 1
                    continue
                n = min(req.num_tokens - hit_tokens, budget)
                if not kv.allocate_slots(
                    req.request_id, req.all_token_ids, req.block_hashes, hit_tokens, n, hit_blocks, self.max_model_len
                ):
                    break
                del waiting[i]
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
        total = len(req.all_token_ids)
        if n == 1 and p + 1 == total and (req.output_token_ids or req.kv_loaded):
            plan.decode_contexts.append(total)
        else:
            plan.prefill_chunks.append((p, n))
            if p + n == total:
                plan.prefills_done += 1
                plan.prefills_done_tokens += total
        plan.scheduled.append((req, n))
        req.num_computed_tokens = p + n

    def _preempt(self, req: SimRequest) -> None:
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.kv_loaded = False
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
        if req.hold_blocks:
            self.held[req.request_id] = req
        else:
            self.kv.free(req.request_id)
        req.status = RequestStatus.FINISHED
