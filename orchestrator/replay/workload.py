"""What a replay serves: requests with arrival times, lengths and content, from a Mooncake trace or made up.

A request is (arrival s, input_length, output_length, hash_ids): its prompt is its trace blocks in order, cut
to input_length, each hash id one block of `trace_block` tokens (512 in Mooncake traces); equal ids are equal
content. Token ids are deterministic per id: (id mod 2^30) + 2, (id >> 30) + 2, then a fixed filler, so two
prompts share exactly the leading blocks their hash ids share (every engine and router hash chains blocks, so
the filler repeats nowhere that matters) and a prompt costs a few list extends to build.

Mooncake JSONL rows: `timestamp` (ms; or `delay` ms after the previous row), `input_length`, `output_length`,
`hash_ids`, optional `session_id`. `time_scale` divides the trace's times: 2 replays it at twice its request
rate (Dynamo's `arrival_speedup_ratio`).

Synthetic loads (workload.synthetic / `--synthetic KIND:key=value,...`), all seeded:
    poisson        rate req/s, requests or duration s; isl, osl (fixed; `dist=exp` for exponential lengths)
    shared-prefix  prefixes × prefix_tokens shared, + suffix_tokens unique, osl, Poisson rate (routing.py's)
    sessions       multi-turn conversations at a Poisson rate (bodies below)
    daily          a compressed day: rate(t) = trough + (peak − trough)(1 − cos 2πt/T)/2 over `minutes`, plus
                   `bursts` bursts ×burst_factor for burst_s each at seeded times (benchmarks/planner_sim.py's)
    walk           a load shape nobody tuned to: the rate is redrawn every step_s as rate·exp(N(0, sigma)),
                   clipped to [lo, hi], with `spikes` flash crowds ×spike_factor of 60–300 s
Bodies of sessions/daily/walk: conversations (system prompts shared by `groups` groups, turns that resend the
whole conversation so far plus a new user message), or rows drawn from a trace (`bodies=PATH`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["SYNTHETIC_KINDS", "TraceRequest", "Workload", "WorkloadError", "load_mooncake", "parse_synthetic", "synthetic"]

MASK30 = (1 << 30) - 1


class WorkloadError(ValueError):
    """A trace or synthetic spec that cannot be read."""


@dataclass(slots=True)
class TraceRequest:
    arrival: float  # seconds from the start
    input_length: int
    output_length: int
    hash_ids: list[int]
    session: str | None = None


@dataclass
class Workload:
    requests: list[TraceRequest]
    trace_block: int = 512
    name: str = "workload"
    description: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._filler = list(range(1000, 1000 + max(self.trace_block - 2, 0)))

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def duration(self) -> float:
        return self.requests[-1].arrival if self.requests else 0.0

    def tokens(self, r: TraceRequest) -> list[int]:
        """The prompt's token ids (see the module docstring)."""
        out: list[int] = []
        filler, n = self._filler, r.input_length
        for h in r.hash_ids:
            out.append((h & MASK30) + 2)
            out.append((h >> 30) + 2)
            out += filler
            if len(out) >= n:
                break
        if len(out) > n:
            del out[n:]
        elif len(out) < n:  # fewer hash ids than the length needs: the rest is this request's own
            k = id(r) & MASK30
            out += [(k + i) % 99991 + 200000 for i in range(n - len(out))]
        return out

    def write_mooncake(self, path: Path) -> Path:
        """This workload as Mooncake JSONL (timestamps in ms), e.g. for another replay."""
        with Path(path).open("w") as f:
            for r in self.requests:
                row = {"timestamp": round(r.arrival * 1000.0, 3), "input_length": r.input_length,
                       "output_length": r.output_length, "hash_ids": r.hash_ids}
                f.write(json.dumps(row) + "\n")
        return Path(path)

    def stats(self) -> dict:
        n = len(self.requests)
        if not n:
            return {"requests": 0}
        isl = np.array([r.input_length for r in self.requests], dtype=float)
        osl = np.array([r.output_length for r in self.requests], dtype=float)
        dur = self.duration
        return {"requests": n, "duration_s": round(dur, 1), "rate": round(n / dur, 3) if dur > 0 else None,
                "isl_mean": round(float(isl.mean()), 1), "isl_p50": float(np.median(isl)), "isl_max": int(isl.max()),
                "osl_mean": round(float(osl.mean()), 1), "trace_block": self.trace_block}


# ---------------------------------------------------------------- Mooncake traces

def _rows(path: Path) -> Iterable[dict]:
    with Path(path).open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise WorkloadError(f"{path}:{lineno}: a row must be a JSON object")
            yield row


def load_mooncake(path: str | Path, time_scale: float = 1.0, limit: int | None = None, skip: int = 0,
                  trace_block: int = 512, osl_scale: float = 1.0) -> Workload:
    """A Mooncake JSONL trace; arrivals start at 0 and are divided by `time_scale`; output lengths are
    ceil(output_length × osl_scale) (at least 1)."""
    if time_scale <= 0 or osl_scale <= 0:
        raise WorkloadError("time_scale and osl_scale must be > 0")
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"trace {path} not found")
    out: list[TraceRequest] = []
    t = 0.0
    t0: float | None = None
    for i, row in enumerate(_rows(path)):
        if i < skip:
            continue
        if limit is not None and len(out) >= limit:
            break
        try:
            if "timestamp" in row:
                t = float(row["timestamp"]) / 1000.0
            else:
                t += float(row.get("delay", 0.0)) / 1000.0
            isl, osl = int(row["input_length"]), int(row["output_length"])
            ids = [int(h) for h in row.get("hash_ids", [])]
        except (KeyError, TypeError, ValueError) as exc:
            raise WorkloadError(f"{path}: row {i + 1}: needs timestamp|delay, input_length, output_length, hash_ids ({exc})") from None
        if isl < 1 or osl < 0 or any(h < 0 for h in ids):
            raise WorkloadError(f"{path}: row {i + 1}: input_length >= 1, output_length >= 0 and hash ids >= 0 required")
        if t0 is None:
            t0 = t
        osl = math.ceil(osl * osl_scale) if osl_scale != 1.0 else osl
        out.append(TraceRequest((t - t0) / time_scale, isl, max(osl, 1), ids, row.get("session_id")))
    out.sort(key=lambda r: r.arrival)
    if not out:
        raise WorkloadError(f"trace {path} has no requests")
    desc = f"{path.name}, {len(out)} requests, times ÷{time_scale:g}" + (f", OSL ×{osl_scale:g}" if osl_scale != 1.0 else "")
    return Workload(out, trace_block, path.stem, desc,
                    {"source": str(path), "time_scale": time_scale, "skip": skip, "limit": limit, "osl_scale": osl_scale})


# ---------------------------------------------------------------- synthetic loads

SYNTHETIC_KINDS: dict[str, dict[str, float | str]] = {
    "poisson": {"rate": 5.0, "requests": 1000, "duration": 0.0, "isl": 2048, "osl": 256, "dist": "fixed", "block": 512},
    "shared-prefix": {"rate": 20.0, "requests": 384, "prefixes": 64, "prefix_tokens": 8192, "suffix_tokens": 256, "osl": 32,
                      "block": 256},
    "sessions": {"rate": 5.0, "requests": 2000, "duration": 0.0, "groups": 16, "system_tokens": 2048, "user_tokens": 1024,
                 "osl": 256, "turns": 4, "max_context": 32768, "block": 512, "bodies": ""},
    "daily": {"minutes": 240.0, "peak": 40.0, "trough": 8.0, "bursts": 3, "burst_factor": 1.6, "burst_s": 180.0, "groups": 16,
              "system_tokens": 2048, "user_tokens": 1024, "osl": 256, "turns": 4, "max_context": 32768, "block": 512, "bodies": ""},
    "walk": {"minutes": 120.0, "start": 15.0, "lo": 3.0, "hi": 45.0, "step_s": 120.0, "sigma": 0.25, "spikes": 2,
             "spike_factor": 2.0, "groups": 16, "system_tokens": 2048, "user_tokens": 1024, "osl": 256, "turns": 4, "max_context": 32768,
             "block": 512, "bodies": ""},
}


def parse_synthetic(spec: str) -> tuple[str, dict]:
    """'kind:key=value,...' -> (kind, params with defaults filled)."""
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in SYNTHETIC_KINDS:
        raise WorkloadError(f"unknown synthetic load {kind!r}; known: {', '.join(SYNTHETIC_KINDS)}")
    params = dict(SYNTHETIC_KINDS[kind])
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, val = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in params:
            raise WorkloadError(f"synthetic {kind}: bad parameter {item!r}; known: {', '.join(params)}")
        default = params[key]
        try:
            params[key] = val.strip() if isinstance(default, str) else type(default)(float(val)) if isinstance(default, int) else float(val)
        except ValueError:
            raise WorkloadError(f"synthetic {kind}: {key} must be a number, not {val!r}") from None
    return kind, params


class _Ids:
    """Fresh hash ids (content nobody else has)."""

    def __init__(self, start: int = 1 << 40) -> None:
        self.next = start

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _lengths(rng: np.random.Generator, mean: float, n: int, dist: str = "lognormal") -> np.ndarray:
    if dist == "fixed":
        return np.full(n, max(1, int(round(mean))))
    if dist == "exp":
        return np.maximum(1, rng.exponential(mean, n).round()).astype(int)
    sigma = 0.8  # lognormal with this mean: long-tailed like chat prompts
    return np.maximum(1, rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, n).round()).astype(int)


class _Conversations:
    """Bodies: a request either starts a session (a system prompt of one of `groups`, then a user message) or
    continues one (its whole history so far, the last answer, a new user message); ~`turns` turns per session."""

    def __init__(self, rng: np.random.Generator, p: dict, block: int, ids: _Ids) -> None:
        self.rng, self.block, self.ids = rng, block, ids
        self.turns = max(1.0, float(p["turns"]))
        self.user, self.osl = float(p["user_tokens"]), float(p["osl"])
        self.max_context = int(p["max_context"])  # a session this long ends; its next turn starts a new one
        sys_blocks = max(1, int(p["system_tokens"]) // block)
        self.systems = [ids.take(sys_blocks) for _ in range(max(1, int(p["groups"])))]
        self.open: list[list] = []  # [history ids, history tokens, session id]
        self.count = 0

    def next(self) -> tuple[int, int, list[int], str]:
        rng, b = self.rng, self.block
        k = int(rng.integers(len(self.open))) if self.open and rng.random() > 1.0 / self.turns else -1
        if k >= 0 and self.open[k][1] + 4 * self.user > self.max_context:
            self.open.pop(k)
            k = -1
        if k >= 0:
            ids, length, sid = self.open[k]
        else:
            sys_ids = self.systems[int(rng.integers(len(self.systems)))]
            ids, length, sid = list(sys_ids), len(sys_ids) * b, f"s{self.count}"
            self.count += 1
            self.open.append([ids, length, sid])
            k = len(self.open) - 1
            if len(self.open) > 4096:  # sessions are finite: the oldest ones end
                self.open.pop(0)
                k -= 1
        length += int(_lengths(rng, self.user, 1)[0])
        need = -(-length // b)
        ids = ids + self.ids.take(max(0, need - len(ids)))  # the new message: this session's own content
        osl = int(_lengths(rng, self.osl, 1)[0])
        nxt = length + osl  # the answer is history for the next turn (fresh content: engines generate their own tokens)
        self.open[k] = [ids + self.ids.take(max(0, -(-nxt // b) - len(ids))), nxt, sid]
        return length, osl, ids[:need], sid


class _TraceBodies:
    """Bodies drawn at random from a trace's rows (lengths and content)."""

    def __init__(self, rng: np.random.Generator, path: str) -> None:
        self.rng = rng
        self.rows = load_mooncake(path).requests

    def next(self) -> tuple[int, int, list[int], str | None]:
        r = self.rows[int(self.rng.integers(len(self.rows)))]
        return r.input_length, r.output_length, r.hash_ids, r.session


def _poisson(rng: np.random.Generator, rate_fn, t_end: float, top: float) -> list[float]:
    """Arrivals of a Poisson process of rate rate_fn(t) <= top on [0, t_end), by thinning."""
    out, t = [], 0.0
    while True:
        t += float(rng.exponential(1.0 / top))
        if t >= t_end:
            return out
        if rng.random() * top < rate_fn(t):
            out.append(t)


def _shape(kind: str, p: dict, rng: np.random.Generator) -> tuple[callable, float, float, dict]:
    """(rate(t), duration s, max rate, what was drawn) of the time-varying loads."""
    T = float(p["minutes"]) * 60.0
    if kind == "daily":
        bursts = sorted(float(b) for b in rng.uniform(0.1 * T, 0.9 * T, size=int(p["bursts"])))
        peak, trough, bf, bs = float(p["peak"]), float(p["trough"]), float(p["burst_factor"]), float(p["burst_s"])

        def rate(t: float) -> float:
            r = trough + (peak - trough) * (1 - math.cos(2 * math.pi * t / T)) / 2
            return r * bf if any(b <= t < b + bs for b in bursts) else r

        return rate, T, peak * max(bf, 1.0), {"bursts_s": [round(b, 1) for b in bursts]}
    steps = max(1, int(math.ceil(T / float(p["step_s"]))))
    lo, hi = float(p["lo"]), float(p["hi"])
    levels, r = [], float(p["start"])
    for _ in range(steps):
        levels.append(r)
        r = min(hi, max(lo, r * math.exp(float(rng.normal(0.0, float(p["sigma"]))))))
    spikes = [(float(rng.uniform(0.05 * T, 0.95 * T)), float(rng.uniform(60.0, 300.0))) for _ in range(int(p["spikes"]))]
    sf, step_s = float(p["spike_factor"]), float(p["step_s"])

    def rate(t: float) -> float:
        base = levels[min(int(t // step_s), steps - 1)]
        return base * sf if any(s <= t < s + d for s, d in spikes) else base

    return rate, T, hi * max(sf, 1.0), {"levels": [round(v, 2) for v in levels], "spikes": [[round(s, 1), round(d, 1)] for s, d in spikes]}


def synthetic(spec: str, seed: int = 7) -> Workload:
    """A seeded synthetic load from 'kind:key=value,...' (kinds and defaults: SYNTHETIC_KINDS)."""
    kind, p = parse_synthetic(spec)
    rng = np.random.default_rng(seed)
    block = int(p["block"])
    if block < 2:
        raise WorkloadError("block must be >= 2 tokens")
    ids = _Ids()
    out: list[TraceRequest] = []
    meta: dict = {"kind": kind, "params": p, "seed": seed}
    if kind in ("poisson", "shared-prefix"):
        rate = float(p["rate"])
        if rate <= 0:
            raise WorkloadError("rate must be > 0")
        n = int(p["requests"])
        if kind == "poisson" and float(p["duration"]) > 0:
            n = max(1, int(rate * float(p["duration"])))
        t = np.cumsum(rng.exponential(1.0 / rate, n)) - 0.0
        t -= t[0]
        if kind == "poisson":
            isl, osl = _lengths(rng, float(p["isl"]), n, str(p["dist"])), _lengths(rng, float(p["osl"]), n, str(p["dist"]))
            for i in range(n):
                out.append(TraceRequest(float(t[i]), int(isl[i]), int(osl[i]), ids.take(-(-int(isl[i]) // block))))
        else:
            pt, st = int(p["prefix_tokens"]), int(p["suffix_tokens"])
            if pt % block:
                raise WorkloadError(f"shared-prefix: prefix_tokens must be a multiple of block ({block})")
            prefixes = [ids.take(pt // block) for _ in range(int(p["prefixes"]))]
            for i in range(n):
                k = int(rng.integers(len(prefixes)))
                out.append(TraceRequest(float(t[i]), pt + st, int(p["osl"]), prefixes[k] + ids.take(-(-st // block)), f"prefix{k}"))
    else:
        bodies = _TraceBodies(rng, str(p["bodies"])) if p.get("bodies") else _Conversations(rng, p, block, ids)
        if p.get("bodies"):
            block = 512
        if kind == "sessions":
            rate = float(p["rate"])
            n = int(p["requests"]) if float(p["duration"]) <= 0 else max(1, int(rate * float(p["duration"])))
            times = list(np.cumsum(rng.exponential(1.0 / rate, n)))
            times = [x - times[0] for x in times]
        else:
            rate_fn, T, top, drawn = _shape(kind, p, rng)
            meta.update(drawn)
            times = _poisson(rng, rate_fn, T, top)
        for t in times:
            isl, osl, hids, sid = bodies.next()
            out.append(TraceRequest(float(t), int(isl), int(osl), list(hids), sid))
    if not out:
        raise WorkloadError(f"synthetic {kind}: no requests (rate or duration too small)")
    desc = f"synthetic {kind} ({', '.join(f'{k}={v}' for k, v in p.items() if v != '')}), seed {seed}"
    return Workload(out, block, kind, desc, meta)
