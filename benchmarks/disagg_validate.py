"""Check the virtual-clock driver (disagg_sim.Cluster) against the real-time sim engine, side by side.

At each point one real sim engine is started as kvyard starts it (`python -m workers.sim --speedup S`,
through EngineProcess + SimBackend), and benchmarks/loadgen.py keeps `concurrency` streams of the same
prompt (token ids, `max_tokens=OSL`, `ignore_eos`) busy for `requests` requests. The sim runs with
prefix caching off, so every request prefills its whole prompt, as the grid's unique prompts do.
The virtual driver then serves the same closed-loop workload on one aggregated engine with the same
engine flags (block size 16 as the sim's default, prefix caching off). Compared: TTFT and per-request
TPOT (sum of the client's inter-chunk gaps / (tokens - 1), so chunks that carry several tokens do not
skew it) at p50 and p90; real times are multiplied by S to be in profile milliseconds. The real figures
include HTTP and client overhead (also multiplied by S), so they are expected a little higher.

    python -m benchmarks.disagg_validate [--speedup 0.25]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np

from benchmarks.disagg_sim import Cluster, EngineConfig, Workload
from benchmarks.loadgen import run_load
from benchmarks.sim_fidelity import histogram
from workers.process import EngineProcess
from workers.sim.backend import SimBackend
from workers.sim.profiles import DEFAULT_PROFILE, load_profile
from workers.types import EngineLaunchConfig

MODEL = "sim"
#: (ISL, OSL, concurrency, requests): one request at a time (host overhead alone), then a loaded
#: Dynamo-like short-output point and a longer one
POINTS = [(3000, 150, 1, 6), (3000, 150, 16, 64), (8192, 512, 8, 32)]
#: below 1 the sim runs slower than the profile, so the host's fixed HTTP and client costs (real
#: milliseconds, on a small shared machine tens of them) shrink in profile milliseconds
DEFAULT_SPEEDUP = 0.25


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stats(ttft_ms: list[float], tpot_ms: list[float]) -> dict:
    def p(v: list[float], q: float) -> float | None:
        return round(float(np.percentile(v, q)), 2) if v else None

    return {"ttft_ms": {"p50": p(ttft_ms, 50), "p90": p(ttft_ms, 90)}, "itl_ms": {"p50": p(tpot_ms, 50), "p90": p(tpot_ms, 90)}}


def real_point(profile: str, isl: int, osl: int, concurrency: int, requests: int, speedup: float, max_model_len: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="kvy-disagg-val-"))
    cfg = EngineLaunchConfig(model=profile, served_model_name=MODEL, port=_free_port(), block_size=16,
                             max_model_len=max_model_len, max_num_seqs=256, max_num_batched_tokens=8192,
                             extra_args=["--speedup", str(speedup), "--no-enable-prefix-caching"])
    proc = EngineProcess(SimBackend(), cfg, log_path=work / "sim.log")
    proc.start()
    try:
        asyncio.run(proc.wait_healthy(60))
        prompt = [5 + (k * 7919) % 30000 for k in range(isl)]  # token ids: the sim takes them as they are
        load = asyncio.run(run_load(proc.url, MODEL, concurrency, requests, prompt, osl))  # type: ignore[arg-type]
        metrics = httpx.get(proc.url + "/metrics", timeout=10).text
    finally:
        asyncio.run(proc.stop())
    ok = [r for r in load.results if r.ok]
    if len(ok) != len(load.results):
        bad = next(r for r in load.results if not r.ok)
        raise RuntimeError(f"{len(load.results) - len(ok)} real requests failed, e.g. {bad.error}")
    ttft = [r.ttft_s * 1000 * speedup for r in ok]
    tpot = [sum(r.gaps_s) * 1000 * speedup / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    engine = {}
    for name, key in (("time_to_first_token_seconds", "ttft_ms"), ("inter_token_latency_seconds", "token_gap_ms")):
        total, count = histogram(metrics, name)  # the engine's own view: from its intake, no HTTP or client
        engine[key] = round(total / count * 1000 * speedup, 2) if count else None
    return {**_stats(ttft, tpot), "engine_mean": engine, "prompt_tokens": ok[0].prompt_tokens,
            "completion_tokens": ok[0].completion_tokens, "wall_s": round(load.wall_s, 2)}


def virtual_point(profile: str, isl: int, osl: int, concurrency: int, requests: int, max_model_len: int) -> dict:
    prof = load_profile(profile)
    eng = EngineConfig(block_size=16, max_model_len=max_model_len, enable_prefix_caching=False)
    wl = Workload([isl] * requests, [osl] * requests, concurrency=concurrency, same_prompt=True)
    res = Cluster(prof, "agg", 1, engine=eng).run(wl)
    done = [r for r in res.records if r.finish is not None]
    gaps = [g * 1000 for r in done for g in r.gaps]
    return {**_stats([r.ttft * 1000 for r in done], [r.tpot * 1000 for r in done if r.tokens > 1]),
            "engine_mean": {"ttft_ms": round(float(np.mean([r.ttft * 1000 for r in done])), 2),
                            "token_gap_ms": round(float(np.mean(gaps)), 2) if gaps else None}}


def validate(st=None, points: list[tuple[int, int, int, int]] | None = None, speedup: float = DEFAULT_SPEEDUP) -> dict:
    """Both sides at each point; `st` (disagg.Settings) only names the profile."""
    profile = getattr(st, "profile", DEFAULT_PROFILE)
    out = []
    for isl, osl, conc, n in points or POINTS:
        mml = -(-(isl + osl + 1) // 16) * 16
        real = real_point(profile, isl, osl, conc, n, speedup, mml)
        virt = virtual_point(profile, real["prompt_tokens"] or isl, osl, conc, n, mml)
        rel = {k: {q: (None if not virt[k][q] or real[k][q] is None else round(real[k][q] / virt[k][q] - 1.0, 4))
                   for q in ("p50", "p90")} for k in ("ttft_ms", "itl_ms")}
        rel["engine_mean"] = {k: (None if not virt["engine_mean"][k] or real["engine_mean"][k] is None
                                  else round(real["engine_mean"][k] / virt["engine_mean"][k] - 1.0, 4))
                              for k in ("ttft_ms", "token_gap_ms")}
        out.append({"isl": isl, "osl": osl, "concurrency": conc, "requests": n, "speedup": speedup,
                    "virtual": virt, "real": real, "real_over_virtual_minus_1": rel})
        print(f"validate ISL {isl} OSL {osl} x{conc}: TTFT p50 {virt['ttft_ms']['p50']} / {real['ttft_ms']['p50']} ms, "
              f"TPOT p50 {virt['itl_ms']['p50']} / {real['itl_ms']['p50']} ms, engine mean TTFT {virt['engine_mean']['ttft_ms']} / "
              f"{real['engine_mean']['ttft_ms']} ms (virtual / real)", file=sys.stderr)
    return {"points": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speedup", type=float, default=DEFAULT_SPEEDUP)
    ap.add_argument("--profile", default=DEFAULT_PROFILE)
    ns = ap.parse_args(argv)

    class _St:
        profile = ns.profile

    print(json.dumps(validate(_St(), speedup=ns.speedup), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
