"""Aggregated vs disaggregated vs conditional P/D serving: goodput per GPU over an ISL x OSL grid.

    python -m benchmarks disagg [--quick] [--gpus 8] [--isl 1024 3000 8192 32768] [--osl 64 150 512 1024]
                        [--ttft-ms 200] [--ttft-factor 2] [--itl-ms 10] [--attainment 0.9]
                        [--kv-bandwidth-gbs 100] [--kv-latency-ms 1] [--kv-dtype-bytes 2] [--validate]

Every cell serves fixed-size requests (ISL, OSL) arriving by a Poisson process on `--gpus` simulated
GPUs of the H200 / Llama-3.1-8B-FP8 profile, each GPU one sim engine (the sim's own Scheduler,
KvBlockManager and TimingModel on a virtual clock: benchmarks/disagg_sim.py), in three modes:
    agg          every GPU prefills and decodes (least-active-tokens routing)
    disagg       xP + yD, x + y = --gpus; the split is searched per cell (best one reported)
    conditional  as disagg, plus Dynamo's IslOrLoad rule for prefilling on the decode worker

SLO (per request): TTFT <= max(--ttft-ms, --ttft-factor x the profile's unloaded prefill time of the
ISL) and TPOT (mean inter-token latency of the request) <= --itl-ms. KV hand-off: the sim's transfer
model, bytes per token from the model geometry (Llama-3.1-8B, BF16 KV: 128 KiB) at --kv-bandwidth-gbs
(100: one node over NVLink, as Dynamo's one-node figure) plus --kv-latency-ms. The defaults, 200 ms and 10 ms,
are the targets of Dynamo's own SLA-planner goodput test for this model and GPU (Llama-3.1-8B-FP8 on
H200); the factor only matters where the prompt alone cannot be prefilled in
100 ms (ISL >= ~5k), so long prompts are not ruled out by physics.
Goodput per GPU of a mode = the highest Poisson request rate per GPU at which at least --attainment of
the requests (after a warm-up) meet both SLOs (DistServe's definition), found by bisection in log
space to --precision; the same arrival draws (common random numbers) at every rate and split.
For P/D the split is searched at each probed rate: start at the last good split, move towards the
side whose queues caused the misses, stop when the direction reverses.

Writes benchmarks/results/disagg.json (every probe of every cell), disagg.md and disagg.png (heat maps
of disagg/agg and conditional/agg goodput over ISL x OSL). `--validate` first runs the real-time sim
(python -m workers.sim --speedup N) at two grid points beside the virtual driver (disagg_validate.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks.disagg_sim import Cluster, Conditional, EngineConfig, KvTransfer, RunResult, Workload, poisson_arrivals
from workers.sim.profiles import DEFAULT_PROFILE, load_profile
from workers.sim.timing import TimingModel

RESULTS = Path(__file__).resolve().parent / "results"
FULL_ISL = [1024, 3000, 8192, 32768]
FULL_OSL = [64, 150, 512, 1024]
QUICK_ISL = [1024, 8192]
QUICK_OSL = [64, 512]


@dataclass(frozen=True)
class Slo:
    ttft_ms: float = 200.0
    ttft_factor: float = 2.0
    itl_ms: float = 10.0
    attainment: float = 0.9

    def ttft_s(self, timing: TimingModel, isl: int) -> float:
        return max(self.ttft_ms, self.ttft_factor * timing.ttft_ms(isl)) / 1000.0


@dataclass(frozen=True)
class Settings:
    profile: str = DEFAULT_PROFILE
    gpus: int = 8
    #: a probe offers load for warm-up + window + tail and measures the requests arriving in the window;
    #: lengths in unloaded request lifetimes L = prefill time + OSL x ITL target (at least `min_measured`
    #: requests in the window); the run ends when the last measured request has finished
    warmup_lifetimes: float = 1.0
    window_lifetimes: float = 1.5
    min_measured: int = 120
    seed: int = 0
    precision: float = 0.07  # relative width of the final rate bracket
    slo: Slo = Slo()
    transfer: KvTransfer = KvTransfer()
    conditional: Conditional = Conditional()
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


class CellSearch:
    """All probes of one (ISL, OSL) cell."""

    def __init__(self, st: Settings, isl: int, osl: int, gpus: int | None = None) -> None:
        self.st, self.isl, self.osl = st, isl, osl
        self.gpus = gpus or st.gpus
        self.profile = load_profile(st.profile)
        self.timing = TimingModel(self.profile)
        bs = self.profile.block_size
        self.engine = EngineConfig(max_num_seqs=st.max_num_seqs, max_num_batched_tokens=st.max_num_batched_tokens,
                                   max_model_len=-(-(isl + osl + 1) // bs) * bs)
        self.ttft_s = st.slo.ttft_s(self.timing, isl)
        self.tpot_s = st.slo.itl_ms / 1000.0
        self.lifetime_s = (self.timing.ttft_ms(isl) + osl * st.slo.itl_ms) / 1000.0
        self.unit_arrivals = poisson_arrivals(1000, 1.0, st.seed)  # extended on demand, same draws
        self.probes: list[dict] = []

    # ---- one probe -----------------------------------------------------------------------------
    def probe(self, mode: str, rate_per_gpu: float, n_prefill: int = 0) -> dict:
        st = self.st
        lam = rate_per_gpu * self.gpus
        L = self.lifetime_s
        t0 = st.warmup_lifetimes * L
        t1 = t0 + max(st.window_lifetimes * L, st.min_measured / lam)
        t_end = t1 + L  # tail: the last measured requests still see load
        while self.unit_arrivals[-1] < t_end * lam:
            more = poisson_arrivals(len(self.unit_arrivals), 1.0, st.seed + len(self.unit_arrivals))
            self.unit_arrivals = np.concatenate([self.unit_arrivals, self.unit_arrivals[-1] + more])
        arrivals = self.unit_arrivals / lam
        n = int(np.searchsorted(arrivals, t_end))
        m0, m1 = int(np.searchsorted(arrivals, t0)), int(np.searchsorted(arrivals, t1))
        wl = Workload([self.isl] * n, [self.osl] * n, arrivals[:n])
        budget = int(math.floor((1.0 - st.slo.attainment) * (m1 - m0) + 1e-9))
        cluster = Cluster(self.profile, mode, self.gpus, n_prefill, engine=self.engine, transfer=st.transfer,
                          conditional=st.conditional, timing=self.timing)
        res = cluster.run(wl, ttft_slo=self.ttft_s, tpot_slo=self.tpot_s, violation_budget=budget, measured=(m0, m1))
        point = self._summarize(res, mode, rate_per_gpu, n_prefill, m0, m1)
        self.probes.append(point)
        return point

    def _summarize(self, res: RunResult, mode: str, rate: float, n_prefill: int, m0: int, m1: int) -> dict:
        recs = res.records[m0:m1]
        done = [r for r in recs if r.finish is not None]
        good = [r for r in done if r.ttft <= self.ttft_s and r.tpot <= self.tpot_s]
        attainment = len(good) / len(recs)
        ok = attainment >= self.st.slo.attainment and not res.stopped_early
        span = (max(r.finish for r in done) - recs[0].arrival) if done else 0.0  # type: ignore[type-var]
        ttft = [r.ttft * 1000 for r in done]
        tpot = [r.tpot * 1000 for r in done if r.tokens > 1]
        gaps = [g * 1000 for r in done for g in r.gaps]
        # which side caused the misses: the prefill queue (time to leave prefill) or the decode side
        pre_side = dec_side = 0
        for r in recs:
            if r.first_token is not None and r.finish is not None and r.ttft <= self.ttft_s and r.tpot <= self.tpot_s:
                continue
            if r.first_token is None and r.finish is None and not r.violated:
                continue  # still in flight when the run stopped, not known to miss
            if r.prefill_worker >= 0 and (r.prefill_done is None or (r.first_token is not None and r.ttft > self.ttft_s
                                                                     and r.prefill_done - r.arrival > r.first_token - r.prefill_done)):
                pre_side += 1
            else:
                dec_side += 1
        return {
            "mode": mode, "n_prefill": n_prefill, "n_decode": self.gpus - n_prefill if mode != "agg" else 0,
            "rate_per_gpu": round(rate, 4), "ok": ok, "stopped_early": res.stopped_early,
            "attainment": round(attainment, 4), "completed": len(done), "measured": len(recs),
            "throughput_per_gpu": round(len(done) / span / self.gpus, 4) if span > 0 else 0.0,
            "goodput_per_gpu": round(len(good) / span / self.gpus, 4) if span > 0 else 0.0,
            "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90)},
            "itl_ms": {"p50": pct(tpot, 50), "p90": pct(tpot, 90)},  # per-request TPOT
            "token_gap_ms": {"p50": pct(gaps, 50), "p90": pct(gaps, 90), "p99": pct(gaps, 99)},
            "misses": {"prefill_side": pre_side, "decode_side": dec_side},
            "local_prefills": dict(res.local_prefills),  # all requests that arrived, by reason
            "local_prefill_share": round(sum(r.local_prefill_reason is not None for r in recs) / len(recs), 4),
            "requests_offered": len(res.records), "virtual_s": round(res.end_time, 3),
            "preemptions": res.preemptions,
        }

    # ---- searches ------------------------------------------------------------------------------
    def upper_bound(self) -> float:
        """Requests/s per GPU no mode can beat: GPU time per request >= unloaded prefill time plus the
        decode time of `osl` tokens at the best batch that still meets the ITL target."""
        pre_s, decode_s = self.gpu_seconds()
        return 1.0 / (pre_s + decode_s)

    def gpu_seconds(self) -> tuple[float, float]:
        """(prefill, decode) GPU-seconds per request at best: the unloaded prefill time, and `osl` steps
        shared by the largest batch whose ITL (the profile's) meets the target."""
        t, cap = self.timing, self.profile.max_kv_tokens
        ctx = self.isl + self.osl / 2
        best = 0.0
        for b in range(1, self.st.max_num_seqs + 1):
            if b * ctx > cap:
                break
            itl = t.decode_ms([int(ctx)] * b)
            if itl <= self.st.slo.itl_ms:
                best = max(best, b / itl)  # sequences per ms of decode
        decode_s = self.osl / (best * 1000.0) if best > 0 else self.osl * t.decode_ms([int(ctx)]) / 1000.0
        return t.ttft_ms(self.isl) / 1000.0, decode_s

    def search(self, feasible, guess: float, factor: float = 1.5) -> tuple[float, dict | None]:
        """Largest rate per GPU with feasible(rate) -> point (or None): from `guess`, step by `factor`
        until the answer flips, then bisect in log space to `precision`. Low rates are the costly
        probes (long virtual time, small batches), so the search starts high and walks down."""
        lo = hi = guess
        point = feasible(guess)
        best = point
        if point is not None:
            while True:
                hi = lo * factor
                p = feasible(hi)
                if p is None:
                    break
                lo, best = hi, p
        else:
            while True:
                lo = hi / factor
                if lo < guess / 1000:  # even a light load misses the SLO
                    return 0.0, None
                best = feasible(lo)
                if best is not None:
                    break
                hi = lo
        while hi / lo > 1.0 + self.st.precision:
            mid = math.sqrt(lo * hi)
            p = feasible(mid)
            if p is not None:
                lo, best = mid, p
            else:
                hi = mid
        return lo, best

    def agg(self) -> tuple[float, dict | None]:
        def feasible(rate: float) -> dict | None:
            p = self.probe("agg", rate)
            return p if p["ok"] else None

        return self.search(feasible, 0.6 * self.upper_bound())

    def pd(self, mode: str, guess: float | None = None, split: int | None = None, factor: float = 1.5) -> tuple[float, dict | None]:
        """Goodput of a P/D mode; the split is searched at every probed rate (see the module doc)."""
        g = self.gpus
        pre, dec = self.gpu_seconds()
        if split is None:
            split = min(g - 1, max(1, round(g * pre / (pre + dec))))  # first guess: the work shares
        state = {"split": split}

        def feasible(rate: float) -> dict | None:
            s = state["split"]
            tried: dict[int, dict] = {}
            direction = 0
            while 1 <= s <= g - 1 and s not in tried:
                p = tried[s] = self.probe(mode, rate, s)
                if p["ok"]:
                    state["split"] = s
                    return p
                d = 1 if p["misses"]["prefill_side"] > p["misses"]["decode_side"] else -1
                if direction and d != direction:
                    return None
                direction = d
                s += d
            return None

        return self.search(feasible, guess or 0.6 * self.upper_bound(), factor)


def run_cell(st: Settings, isl: int, osl: int, gpus: int | None = None) -> dict:
    t0 = time.process_time()
    cs = CellSearch(st, isl, osl, gpus)
    out: dict = {"isl": isl, "osl": osl, "gpus": cs.gpus, "ttft_target_ms": round(cs.ttft_s * 1000, 1),
                 "itl_target_ms": st.slo.itl_ms, "upper_bound_per_gpu": round(cs.upper_bound(), 4), "modes": {}}
    guess, split = None, None
    for mode in ("agg", "disagg", "conditional"):
        # conditional differs from disagg only where its rule fires: start at disagg's answer, small steps
        factor = 1.0 + 2 * st.precision if mode == "conditional" else 1.5
        rate, point = cs.agg() if mode == "agg" else cs.pd(mode, guess, split, factor)
        out["modes"][mode] = {"goodput_per_gpu": round(rate, 4), "at": point,
                              "split": f"{point['n_prefill']}P{point['n_decode']}D" if point and mode != "agg" else None}
        if rate > 0:  # the next mode starts where this one ended (goodputs differ by tens of percent)
            guess = rate
            if point is not None and mode != "agg":
                split = point["n_prefill"]
    a = out["modes"]["agg"]["goodput_per_gpu"]
    for mode in ("disagg", "conditional"):
        g = out["modes"][mode]["goodput_per_gpu"]
        out[f"{mode}_over_agg"] = round(g / a, 4) if a > 0 else None  # None: aggregated meets the SLO at no rate
    out["probes"] = cs.probes
    out["cpu_s"] = round(time.process_time() - t0, 2)
    return out


# ---- output ------------------------------------------------------------------------------------
def _ratio_grid(cells: list[dict], isls: list[int], osls: list[int], key: str) -> np.ndarray:
    z = np.full((len(isls), len(osls)), np.nan)
    for c in cells:
        r = c.get(key)
        if r is not None and math.isfinite(r):
            z[isls.index(c["isl"]), osls.index(c["osl"])] = r
    return z


def plot(cells: list[dict], isls: list[int], osls: list[int], path: Path, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    fig, axes = plt.subplots(1, 2, figsize=(11, 0.7 * len(isls) + 2.6), constrained_layout=True)
    grids = [_ratio_grid(cells, isls, osls, k) for k in ("disagg_over_agg", "conditional_over_agg")]
    vals = np.concatenate([g[np.isfinite(g)] for g in grids]) if any(np.isfinite(g).any() for g in grids) else np.array([1.0])
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(0.5, float(vals.min()) * 0.95), vmax=max(1.5, float(vals.max()) * 1.05))
    for ax, z, name in zip(axes, grids, ("disaggregated / aggregated", "conditional / aggregated")):
        im = ax.imshow(z, cmap="RdBu", norm=norm, origin="lower", aspect="auto")
        ax.set_xticks(range(len(osls)), [str(o) for o in osls])
        ax.set_yticks(range(len(isls)), [str(i) for i in isls])
        ax.set_xlabel("OSL (tokens)")
        ax.set_ylabel("ISL (tokens)")
        ax.set_title(f"goodput/GPU, {name}")
        for i in range(len(isls)):
            for j in range(len(osls)):
                ax.text(j, i, "n/a" if not np.isfinite(z[i, j]) else f"{z[i, j]:.2f}", ha="center", va="center", fontsize=9)
    fig.colorbar(im, ax=axes, shrink=0.8, label="ratio (>1: better than aggregated)")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _f(x: float | None, nd: int = 1) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def markdown(res: dict) -> str:
    cfg = res["config"]
    lines = [
        "# Aggregated vs disaggregated vs conditional P/D (virtual-clock sim engines)",
        "",
        f"Profile `{cfg['profile']}`, {cfg['gpus']} GPUs per deployment, Poisson arrivals; a probe measures the requests "
        f"arriving in {cfg['window_lifetimes']:g} unloaded request lifetimes (at least {cfg['min_measured']}) after "
        f"{cfg['warmup_lifetimes']:g} of warm-up. SLO per request: TTFT <= max({cfg['slo']['ttft_ms']:.0f} ms, "
        f"{cfg['slo']['ttft_factor']:g} x unloaded prefill) and TPOT <= {cfg['slo']['itl_ms']:g} ms; goodput = highest "
        f"rate/GPU with >= {cfg['slo']['attainment']:.0%} of requests meeting both. KV transfer "
        f"{cfg['transfer']['bytes_per_token']} B/token at {cfg['transfer']['bandwidth_gbs']:g} GB/s + "
        f"{cfg['transfer']['latency_ms']:g} ms. Conditional: IslOrLoad (isl < {cfg['conditional']['isl_threshold']} and "
        f"ratio < {cfg['conditional']['ratio_threshold']:g}, or prefill backlog > {cfg['conditional']['queue_threshold']:g} x "
        f"max_num_batched_tokens).",
        "",
        "| ISL | OSL | TTFT target ms | agg req/s/GPU | disagg req/s/GPU (split) | disagg/agg | conditional (split, local %) | cond/agg | "
        "agg TTFT p90 / TPOT p90 ms | disagg TTFT p90 / TPOT p90 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in res["cells"]:
        m = c["modes"]
        a, d, k = m["agg"], m["disagg"], m["conditional"]

        def lat(x: dict) -> str:
            p = x["at"]
            return "–" if p is None else f"{_f(p['ttft_ms']['p90'], 0)} / {_f(p['itl_ms']['p90'], 2)}"

        local = "" if k["at"] is None else f", {k['at']['local_prefill_share']:.0%}"
        lines.append(
            f"| {c['isl']} | {c['osl']} | {c['ttft_target_ms']:.0f} | {a['goodput_per_gpu']:.2f} | {d['goodput_per_gpu']:.2f} ({d['split'] or '–'}) | "
            f"{_f(c['disagg_over_agg'], 2)} | {k['goodput_per_gpu']:.2f} ({k['split'] or '–'}{local}) | {_f(c['conditional_over_agg'], 2)} | "
            f"{lat(a)} | {lat(d)} |")
    v = res.get("validation")
    if v:
        lines += ["", "## Virtual clock vs the real-time sim (aggregated, one engine, closed loop)", "",
                  "| ISL | OSL | clients | speed-up | TTFT p50 virtual / real ms | TTFT p90 | TPOT p50 | TPOT p90 | engine mean TTFT | engine mean token gap |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for p in v["points"]:
            vi, re_ = p["virtual"], p["real"]
            lines.append(f"| {p['isl']} | {p['osl']} | {p['concurrency']} | {p['speedup']:g} | "
                         + " | ".join(f"{_f(vi[k][q])} / {_f(re_[k][q])}" for k, q in
                                      (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("itl_ms", "p50"), ("itl_ms", "p90")))
                         + " | " + " | ".join(f"{_f(vi['engine_mean'][k])} / {_f(re_['engine_mean'][k])}" for k in ("ttft_ms", "token_gap_ms"))
                         + " |")
        lines += ["", "Real = client side (benchmarks/loadgen.py) and the engine's own histograms (from its intake, no HTTP); "
                  "times x speed-up = profile ms." + (f" {v['note']}." if v.get("note") else "")]
    cpu = sum(c.get("cpu_s", 0.0) for c in res["cells"])
    lines += ["", f"Wall time {res['wall_s']:.0f} s ({cpu:.0f} s of CPU over the cells, --jobs {res['config'].get('jobs', 1)}). "
              "Written by `python -m benchmarks disagg`; every probe is in the JSON.", ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks disagg", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=DEFAULT_PROFILE)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--isl", type=int, nargs="+", default=None, help=f"default {FULL_ISL} ({QUICK_ISL} with --quick)")
    ap.add_argument("--osl", type=int, nargs="+", default=None, help=f"default {FULL_OSL} ({QUICK_OSL} with --quick)")
    ap.add_argument("--quick", action="store_true", help="tiny grid, fewer requests (smoke test)")
    ap.add_argument("--min-measured", type=int, default=None, help="measured requests per probe, at least (default 120; 60 with --quick)")
    ap.add_argument("--warmup-lifetimes", type=float, default=1.0, help="warm-up, in unloaded request lifetimes")
    ap.add_argument("--window-lifetimes", type=float, default=1.5, help="measurement window, in unloaded request lifetimes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", type=float, default=None, help="relative rate precision (default 0.07; 0.15 with --quick)")
    ap.add_argument("--ttft-ms", type=float, default=200.0)
    ap.add_argument("--ttft-factor", type=float, default=2.0, help="TTFT target >= this x the unloaded prefill time")
    ap.add_argument("--itl-ms", type=float, default=10.0, help="per-request TPOT target")
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--kv-bandwidth-gbs", type=float, default=100.0,
                    help="KV transfer bandwidth, GB/s (default 100: one node, NVLink, well under H200's 450 GB/s per "
                         "direction; the sim's own default, 25, is more like a 200 Gb/s NIC between nodes)")
    ap.add_argument("--kv-latency-ms", type=float, default=1.0, help="fixed cost per KV hand-off")
    ap.add_argument("--kv-dtype-bytes", type=int, default=2, help="KV cache dtype bytes (2: BF16, 1: FP8)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--isl-threshold", type=int, default=2048)
    ap.add_argument("--ratio-threshold", type=float, default=0.7)
    ap.add_argument("--queue-threshold", type=float, default=1.0)
    ap.add_argument("--jobs", type=int, default=1, help="cells in parallel (processes)")
    ap.add_argument("--validate", action="store_true", help="also compare with the real-time sim (disagg_validate.py)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--name", default="disagg", help="output file stem")
    return ap


def settings_from(ns: argparse.Namespace) -> Settings:
    return Settings(
        profile=ns.profile, gpus=ns.gpus, seed=ns.seed,
        warmup_lifetimes=ns.warmup_lifetimes, window_lifetimes=ns.window_lifetimes,
        min_measured=ns.min_measured or (60 if ns.quick else 120),
        precision=ns.precision or (0.15 if ns.quick else 0.07),
        slo=Slo(ns.ttft_ms, ns.ttft_factor, ns.itl_ms, ns.attainment),
        transfer=KvTransfer(ns.layers, ns.kv_heads, ns.head_dim, ns.kv_dtype_bytes, ns.kv_bandwidth_gbs, ns.kv_latency_ms),
        conditional=Conditional(ns.isl_threshold, ns.ratio_threshold, ns.queue_threshold),
    )  # fmt: skip


def run_grid(st: Settings, isls: list[int], osls: list[int], jobs: int = 1) -> list[dict]:
    cells = [(i, o) for i in isls for o in osls]
    if jobs <= 1:
        return [run_cell(st, i, o) for i, o in cells]
    with ProcessPoolExecutor(max_workers=jobs) as ex:
        return list(ex.map(run_cell, [st] * len(cells), [c[0] for c in cells], [c[1] for c in cells]))


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    st = settings_from(ns)
    isls = ns.isl or (QUICK_ISL if ns.quick else FULL_ISL)
    osls = ns.osl or (QUICK_OSL if ns.quick else FULL_OSL)
    t0 = time.time()
    res: dict = {"config": {**asdict(st), "isl": isls, "osl": osls, "jobs": ns.jobs}}
    res["config"]["transfer"]["bytes_per_token"] = st.transfer.bytes_per_token
    if ns.validate:
        from benchmarks.disagg_validate import validate

        res["validation"] = validate(st)
    cells = run_grid(st, isls, osls, ns.jobs)
    for c in cells:
        print(f"ISL {c['isl']:>5} OSL {c['osl']:>4}: agg {c['modes']['agg']['goodput_per_gpu']:.2f}  disagg "
              f"{c['modes']['disagg']['goodput_per_gpu']:.2f} ({c['modes']['disagg']['split']})  conditional "
              f"{c['modes']['conditional']['goodput_per_gpu']:.2f} ({c['modes']['conditional']['split']}) req/s/GPU  "
              f"[{c['cpu_s']:.0f} s cpu]", file=sys.stderr)
    res["cells"] = cells
    res["wall_s"] = round(time.time() - t0, 1)
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / f"{ns.name}.json").write_text(json.dumps(res, indent=1, default=lambda x: None if x != x else x) + "\n")
    (ns.out / f"{ns.name}.md").write_text(markdown(res))
    title = (f"{st.profile}, {st.gpus} GPUs, TTFT<=max({st.slo.ttft_ms:g} ms, {st.slo.ttft_factor:g}x prefill), "
             f"TPOT<={st.slo.itl_ms:g} ms, {st.slo.attainment:.0%} attainment")
    plot(cells, isls, osls, ns.out / f"{ns.name}.png", title)
    print(f"wrote {ns.out / ns.name}.json/.md/.png in {res['wall_s']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":  # python -m benchmarks.disagg
    raise SystemExit(main())
