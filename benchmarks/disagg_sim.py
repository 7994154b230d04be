"""Virtual-clock driver of the sim engine for aggregated, disaggregated and conditional P/D serving.

Every simulated GPU is one sim engine: the sim's own pure `Scheduler` (vLLM v1 continuous batching,
chunked prefill, paged KV with prefix caching via `KvBlockManager`) timed by its own `TimingModel`
(the NPZ profile). `SimEngine.run` does this in scaled real time; `Cluster` does the same loop on a
virtual clock (a discrete-event heap), so a minute of serving costs only the scheduler's CPU time:

    worker idle + work arrives -> plan, dt = core.plan(); the step ends at now + dt
    step end                   -> core.finish(plan, dt); start the next step if there is work
(core: the sim's EngineCore, workers/sim/core.py, the step loop SimEngine and `kvyard replay` drive too; `kvyard replay`,
orchestrator/replay/, is the product grown from this driver, with the frontend's routers and the planner in the loop.)

Modes (the same GPUs, the same requests):
- ``agg``: every worker does prefill and decode; a request goes to the worker with the fewest active
  tokens (Dynamo's KV router with no prefix overlap reduces to this load term).
- ``disagg``: ``n_prefill`` workers prefill (``max_tokens=1``), ``n_decode`` workers decode, through the
  sim scheduler's own P/D path (what `python -m workers.sim` serves, vLLM's connector semantics): the
  prefill runs with ``hold_blocks`` (its blocks stay held after it finishes); the decode request,
  sent to the decode worker with the fewest active tokens when the prefill finishes, carries
  ``remote`` KV, so that scheduler admits it when its whole sequence fits, allocates the prompt's
  blocks and reports a ``remote_load`` (vLLM's WAITING_FOR_REMOTE_KVS); the pull takes the sim's
  transfer time ``latency + (prompt - local prefix hit) x bytes per token / bandwidth`` (bytes per
  token = layers x KV heads x head dim x 2 (K and V) x dtype bytes); then ``finish_remote_load``
  leaves only the last prompt token, computed as a decode step, and the prefill's held blocks are
  released. The client's first token is the decode worker's first (the prefill's own token is
  discarded, as in vLLM's P/D proxy).
- ``conditional``: as ``disagg``, but the decode worker prefills locally (the request runs there
  whole, as in ``agg``) when Dynamo's ``IslOrLoad`` rule says so:
  ``eff_isl < isl_threshold and eff_isl / prompt < ratio_threshold`` with ``eff_isl = prompt - the
  decode worker's prefix hit``, or the chosen prefill worker's queued prefill tokens exceed
  ``queue_threshold x max_num_batched_tokens``.

Measured per request: TTFT (arrival -> first token) and TPOT (mean inter-token latency, (last - first)
/ (tokens - 1), what aiperf/genai-perf report as a request's ITL), plus every token gap. A run can stop
early once more requests than `violation_budget` have missed the SLO (the answer "attainment below
target" is then already known). Pure and synchronous.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from workers.sim.core import EngineCore
from workers.sim.hashing import BlockHasher
from workers.sim.kv_manager import KvBlockManager
from workers.sim.profiles import Profile
from workers.sim.scheduler import Scheduler, SimRequest, StepPlan
from workers.sim.timing import TimingModel

__all__ = ["EngineConfig", "KvTransfer", "Conditional", "Workload", "RequestRecord", "RunResult", "Cluster", "run"]

MODES = ("agg", "disagg", "conditional")


@dataclass(frozen=True)
class EngineConfig:
    """Per-GPU engine settings: the sim's defaults, except the block size, which defaults to the one the
    profile was measured with (128 for the H200 profile; 8x fewer block operations than the sim's 16).
    max_model_len must hold ISL + OSL."""

    block_size: int | None = None  # None: the profile's
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    num_gpu_blocks: int | None = None  # default: the profile's max_kv_tokens // block_size, as the sim
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class KvTransfer:
    """KV hand-off cost. Defaults: Llama-3.1-8B (32 layers, 8 KV heads, head dim 128), BF16 KV cache."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    bandwidth_gbs: float = 25.0  # GB/s (1e9 bytes/s) per transfer; the sim's --kv-transfer-bandwidth-gbps default
    latency_ms: float = 1.0  # fixed cost per hand-off (the sim's --kv-transfer-latency-ms default)

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes

    def seconds(self, tokens: int) -> float:
        return self.latency_ms / 1000.0 + tokens * self.bytes_per_token / (self.bandwidth_gbs * 1e9)


@dataclass(frozen=True)
class Conditional:
    """Dynamo's conditional disaggregation thresholds (IslOrLoad)."""

    isl_threshold: int = 2048
    ratio_threshold: float = 0.7
    #: x max_num_batched_tokens of queued prefill on the chosen prefill worker; 1.0 = one full batch
    #: (~170 ms of prefill on the H200 profile): a remote prefill behind more would likely miss a 200 ms TTFT
    queue_threshold: float = 1.0


@dataclass
class Workload:
    """Requests in arrival order. Open loop: `arrivals` (seconds). Closed loop: `concurrency` clients,
    each sending its next request when the previous one finishes (arrivals ignored).

    Prompts: request i's prompt is `prompt_len` tokens starting with a token unique to i (so no two
    requests share a block), unless `same_prompt`, when every request has the same prompt.
    """

    isl: Sequence[int]
    osl: Sequence[int]
    arrivals: Sequence[float] | None = None
    concurrency: int = 0
    same_prompt: bool = False

    def __len__(self) -> int:
        return len(self.isl)

    def prompt(self, i: int) -> list[int]:
        n = int(self.isl[i])
        head = 1 if self.same_prompt else 1 + (i % 90000)
        return [head] + [(k * 7919) % 30000 + 2 for k in range(1, min(n, 64))] + [5] * max(0, n - 64)


@dataclass(slots=True)
class RequestRecord:
    index: int
    isl: int
    osl: int
    arrival: float
    worker: int = -1  # the worker that produced the tokens (decode worker in P/D)
    prefill_worker: int = -1  # -1: prefilled where it decoded
    local_prefill_reason: str | None = None  # conditional: why prefill stayed local
    prefill_done: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finish: float | None = None
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    violated: bool = False  # known to miss an SLO (drives early stopping only)

    @property
    def ttft(self) -> float:
        return (self.first_token or 0.0) - self.arrival

    @property
    def tpot(self) -> float:
        if self.tokens <= 1 or self.first_token is None or self.last_token is None:
            return 0.0
        return (self.last_token - self.first_token) / (self.tokens - 1)


@dataclass
class RunResult:
    records: list[RequestRecord]
    end_time: float
    stopped_early: bool
    steps: int
    local_prefills: dict[str, int]
    preemptions: int


class _Worker:
    __slots__ = ("idx", "role", "sched", "kv", "busy", "plan", "dt", "core")

    def __init__(self, idx: int, role: str, profile: Profile, eng: EngineConfig, hasher: BlockHasher) -> None:
        blocks = eng.num_gpu_blocks or profile.max_kv_tokens // eng.block_size  # type: ignore[operator]
        self.idx = idx
        self.role = role  # "both" | "prefill" | "decode"
        self.kv = KvBlockManager(blocks, eng.block_size, enable_caching=eng.enable_prefix_caching, enable_events=False)
        self.sched = Scheduler(self.kv, max_num_seqs=eng.max_num_seqs, max_num_batched_tokens=eng.max_num_batched_tokens,
                               max_model_len=eng.max_model_len, hasher=hasher)
        self.busy = False
        self.plan: StepPlan | None = None
        self.dt = 0.0
        self.core: EngineCore | None = None  # set by the Cluster, with its timing model

    def active_tokens(self) -> int:
        """Load for routing: tokens of every request it holds or will hold (Dynamo's active blocks, in tokens)."""
        s = self.sched
        return sum(len(r.all_token_ids) for r in s.running) + sum(len(r.all_token_ids) for r in s.waiting)

    def prefill_backlog(self) -> int:
        """Active prefill tokens: uncached prompt tokens of every request that has no token yet, queued or
        in the step now running (the scheduler advances `num_computed_tokens` when it plans a step, so
        counting only what is left to plan would make a busy worker look idle). Prefill routing and the
        conditional rule's load both use it (Dynamo tracks prefill tokens until the first token)."""
        s = self.sched
        total = 0
        for reqs in (s.waiting, s.running):
            for r in reqs:
                if not r.output_token_ids and not r.kv_loaded:
                    total += r.num_prompt_tokens - max(r.num_cached_tokens, 0)
        return total


class Cluster:
    def __init__(self, profile: Profile, mode: str, n_gpus: int, n_prefill: int = 0, *, engine: EngineConfig | None = None,
                 transfer: KvTransfer | None = None, conditional: Conditional | None = None,
                 timing: TimingModel | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        if mode != "agg" and not 0 < n_prefill < n_gpus:
            raise ValueError("P/D needs 0 < n_prefill < n_gpus")
        self.mode = mode
        eng = engine or EngineConfig()
        if eng.block_size is None:
            eng = replace(eng, block_size=profile.block_size)
        self.eng = eng
        self.transfer = transfer or KvTransfer()
        self.cond = conditional or Conditional()
        self.timing = timing or TimingModel(profile)
        self.hasher = BlockHasher(self.eng.block_size)
        if mode == "agg":
            roles = ["both"] * n_gpus
        else:
            roles = ["prefill"] * n_prefill + ["decode"] * (n_gpus - n_prefill)
        self.workers = [_Worker(i, r, profile, self.eng, self.hasher) for i, r in enumerate(roles)]
        for w in self.workers:
            w.core = EngineCore(w.sched, self.timing)
            w.core.on_held = lambda _rid, _n: True  # a prefill's blocks stay held until its decode has pulled them
        self.prefill = [w for w in self.workers if w.role == "prefill"]
        self.serving = [w for w in self.workers if w.role != "prefill"]  # produce client tokens
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._source: dict[str, tuple[_Worker, str]] = {}  # decode request id -> (prefill worker, its request id)
        self.now = 0.0
        self.steps = 0

    # ---- event plumbing ------------------------------------------------------------------------
    def _push(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def _kick(self, w: _Worker) -> None:
        """The engine loop (workers/sim/engine.py SimEngine.run) on the virtual clock: if the worker is idle
        and has work, plan a step, start the KV pulls it admitted, and end the step after step_ms."""
        if w.busy or not w.sched.has_work:
            return
        plan, dt = w.core.plan()
        for req, hit in plan.remote_loads:
            self._push(self.now + self.transfer.seconds(req.num_tokens - hit), "landed", (w, req))
        if not plan:
            return  # only pulls started, or nothing fits now: a step end or a landing retries
        w.busy, w.plan, w.dt = True, plan, dt
        self._push(self.now + dt, "step", w)

    # ---- run -----------------------------------------------------------------------------------
    def run(self, wl: Workload, *, ttft_slo: float = float("inf"), tpot_slo: float = float("inf"),
            violation_budget: int | None = None, measured: tuple[int, int] | None = None) -> RunResult:
        """Serve `wl` until every request in the index range `measured` (default: all) has finished, or
        stop early once more than `violation_budget` of them are known to miss `ttft_slo` or `tpot_slo`
        (seconds). A request whose wait already exceeds `ttft_slo` counts at once, so an overloaded run
        stops soon after its queue starts to grow. Requests outside `measured` are load (warm-up, tail)."""
        n = len(wl)
        m0, m1 = measured or (0, n)
        unfinished = m1 - m0
        recs = [RequestRecord(i, int(wl.isl[i]), int(wl.osl[i]), 0.0) for i in range(n)]
        self.by_id: dict[str, RequestRecord] = {}
        self._prompts: dict[int, tuple[list[int], list[bytes]]] = {}
        self._wl = wl
        local = {"isl": 0, "load": 0}
        violations = 0
        budget = n + 1 if violation_budget is None else violation_budget
        stopped = False
        arrived = 0  # requests arrive in index order (open loop: sorted arrivals; closed loop: by design)
        scan = 0  # first request not yet known to have its first token or to have missed the TTFT SLO
        closed = wl.concurrency > 0
        next_closed = min(wl.concurrency, n) if closed else n
        for i in range(next_closed):
            self._push(0.0 if closed else float(wl.arrivals[i]), "arrive", i)  # type: ignore[index]

        def violated(rec: RequestRecord) -> None:
            nonlocal violations, stopped
            if not rec.violated and m0 <= rec.index < m1:
                rec.violated = True
                violations += 1
                stopped = violations > budget

        while self._events and not stopped and unfinished > 0:
            t, _, kind, payload = heapq.heappop(self._events)
            self.now = t
            if kind == "arrive":
                i = payload  # type: ignore[assignment]
                rec = recs[i]
                rec.arrival = t
                arrived = i + 1
                self._route(i, rec, local)
                while scan < arrived and (recs[scan].first_token is not None or t - recs[scan].arrival > ttft_slo):
                    if recs[scan].first_token is None:
                        violated(recs[scan])
                    scan += 1
            elif kind == "step":
                w = payload  # type: ignore[assignment]
                plan, w.plan, w.busy = w.plan, None, False
                self.steps += 1
                result = w.core.finish(plan, w.dt)
                if w.role != "prefill":  # a prefill worker's own token is discarded (vLLM's P/D proxy)
                    for req, toks in result.outputs:
                        rec = self.by_id.get(req.request_id)
                        if rec is None:
                            continue
                        if rec.first_token is None:
                            rec.first_token = t
                            if rec.ttft > ttft_slo:
                                violated(rec)
                        else:
                            rec.gaps.append(t - rec.last_token)  # type: ignore[operator]
                        rec.last_token = t
                        rec.tokens += len(toks)
                for req in result.finished:
                    rec = self.by_id.pop(req.request_id, None)
                    if rec is None:
                        continue
                    if w.role == "prefill":
                        rec.prefill_done = t
                        self._handoff(w, req, rec)
                    else:
                        rec.finish, rec.worker = t, w.idx
                        if m0 <= rec.index < m1:
                            unfinished -= 1
                        if rec.tpot > tpot_slo:
                            violated(rec)
                        if closed and next_closed < n:
                            self._push(t, "arrive", next_closed)
                            next_closed += 1
                self._kick(w)
            elif kind == "landed":  # the pull ended: the decode has its KV, the prefill frees its held blocks
                d, req = payload  # type: ignore[misc]
                d.sched.finish_remote_load(req.request_id, True)
                p, prefill_id = self._source.pop(req.request_id)
                p.sched.release_held(prefill_id)
                self._kick(p)
                self._kick(d)
        return RunResult(recs, self.now, stopped, self.steps, local,
                         sum(w.sched.num_preemptions for w in self.workers))

    # ---- helpers -------------------------------------------------------------------------------
    def _make(self, i: int, request_id: str, max_tokens: int, **kw) -> SimRequest:
        """Request i's SimRequest; prompts and their block hashes are built once per request."""
        key = 0 if self._wl.same_prompt else i
        if key not in self._prompts:
            prompt = self._wl.prompt(i)
            self._prompts[key] = (prompt, self.hasher.hash_all(prompt))
        prompt, hashes = self._prompts[key]
        return SimRequest(request_id=request_id, prompt_token_ids=prompt, max_tokens=max_tokens,
                          all_token_ids=list(prompt), block_hashes=list(hashes), **kw)

    @staticmethod
    def _least(ws: list[_Worker]) -> _Worker:
        return min(ws, key=lambda w: (w.active_tokens(), w.idx))

    def _route(self, i: int, rec: RequestRecord, local: dict[str, int]) -> None:
        req = self._make(i, str(i), rec.osl)
        d = self._least(self.serving)
        if self.mode != "agg":
            p = min(self.prefill, key=lambda w: (w.prefill_backlog(), w.idx))
            reason = self._local_reason(d, p, req) if self.mode == "conditional" else None
            if reason is None:
                rec.prefill_worker = p.idx
                self._submit(p, self._make(i, f"{i}#p", 1, hold_blocks=True), rec)
                return
            local[reason] += 1
            rec.local_prefill_reason = reason
        self._submit(d, req, rec)

    def _submit(self, w: _Worker, req: SimRequest, rec: RequestRecord) -> None:
        self.by_id[req.request_id] = rec
        w.sched.add_request(req)
        self._kick(w)

    def _local_reason(self, d: _Worker, p: _Worker, req: SimRequest) -> str | None:
        """Dynamo's IslOrLoad: why the decode worker should prefill this request itself (None: remote)."""
        prompt = req.num_prompt_tokens
        _, hit = d.kv.get_computed_blocks(req.block_hashes, prompt)
        eff = prompt - hit
        if eff < self.cond.isl_threshold and eff / prompt < self.cond.ratio_threshold:
            return "isl"
        if p.prefill_backlog() > self.cond.queue_threshold * self.eng.max_num_batched_tokens:
            return "load"
        return None

    def _handoff(self, p: _Worker, done: SimRequest, rec: RequestRecord) -> None:
        """A prefill finished (its blocks are held): send the decode request, with remote KV, to the
        decode worker with the fewest active tokens."""
        d = self._least(self.serving)
        req = self._make(rec.index, str(rec.index), rec.osl, remote="prefill")
        self._source[req.request_id] = (p, done.request_id)
        self._submit(d, req, rec)


def run(profile: Profile, mode: str, n_gpus: int, wl: Workload, n_prefill: int = 0, **kw) -> RunResult:
    """Convenience: one Cluster, one workload."""
    run_kw = {k: kw.pop(k) for k in ("ttft_slo", "tpot_slo", "violation_budget", "measured") if k in kw}
    return Cluster(profile, mode, n_gpus, n_prefill, **kw).run(wl, **run_kw)


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """n Poisson arrival times (seconds) at `rate` per second; the same unit-rate draws for every rate."""
    gaps = np.random.default_rng(seed).exponential(1.0, n)
    return np.cumsum(gaps) / rate
