"""Session affinity vs the kv policy alone, on multi-turn loads, side by side: prefix-cache hit rate and TTFT.

    .venv/bin/python benchmarks/affinity.py [--sessions 96 --workers 4 --speedup 0.5 --repeats 2 ...]

Runs per round on fresh `kvyard up` clusters of sim engines (benchmarks/routing.py's Cluster), the same load:
  kv           the default kv policy; the session header is sent but affinity is off (frontend.affinity.enabled false)
  kv+affinity  the same with session affinity on (router/plugins/affinity.py, default TTL and max_load_gap)
and, with `--policies kv,round-robin`, the same pair over round-robin: what the stage does for a policy that
has no view of the caches.

Loads (every request carries `x-session-id`):
  synthetic    closed-loop conversations: `--sessions` sessions start at Poisson times (`--session-rate` per profile
               second); turn 1 is one of `--system-prompts` shared system prompts (`--system-tokens`) + a user message;
               each later turn re-sends the whole history, the previous answer's own token ids included
               (`return_token_ids`), plus a new user message (`--user-tokens` min,max), after a think time (exponential,
               mean `--think-s`); `--turns` min,max turns, answers of `--osl` min,max tokens (ignore_eos).
  mooncake     the first `--trace-requests` rows of benchmarks/data/mooncake_conversation_trace.jsonl replayed open loop
               (routing.py's replay: hash ids -> token blocks, `--compression`, `--osl-scale`), grouped into sessions: a
               row joins the session of the earliest row it shares at least 2 leading hash-id blocks with (1,024 tokens);
               its own KV size, context and speed-up (`--trace-*`), over `--trace-policies`.

Reported per run: TTFT p50/p90/p99 in profile ms (wall x speed-up), the fleet's prefix-cache hit rate
(Δ vllm:prefix_cache_hits / Δ queries over all engines), the turns that moved to another worker than their
session's previous turn, and the affinity stage's outcomes (from /api/cluster). Writes
benchmarks/results/affinity.json and affinity.md. Other work shares the machine: compare runs of one round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import add_cluster_args, result_header  # noqa: E402
from benchmarks.loadgen import percentiles  # noqa: E402
from benchmarks.routing import MODEL, TRACE, VOCAB_HI, VOCAB_LO, Cluster, engine_counters, trace_workload  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


class SessionCluster(Cluster):
    """`kvyard up` with the frontend's affinity on or off."""

    def __init__(self, args, policy: str, affinity: bool, tmp: Path, tag: str) -> None:
        self.setup(args, policy, tmp, tag, args.num_gpu_blocks, ["--workers", str(args.workers)], {"affinity": {"enabled": affinity}})


# ---------------------------------------------------------------- workloads

def synthetic_sessions(args) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    systems = [np.random.default_rng([3, s]).integers(VOCAB_LO, VOCAB_HI, args.system_tokens).tolist() for s in range(args.system_prompts)]
    t, out = 0.0, []
    lo_t, hi_t = (int(x) for x in args.turns.split(","))
    lo_u, hi_u = (int(x) for x in args.user_tokens.split(","))
    lo_o, hi_o = (int(x) for x in args.osl.split(","))
    for s in range(args.sessions):
        t += rng.exponential(1.0 / args.session_rate)
        turns = int(rng.integers(lo_t, hi_t + 1))
        out.append({"id": f"s{s}", "start": t, "system": systems[int(rng.integers(args.system_prompts))],
                    "users": [rng.integers(VOCAB_LO, VOCAB_HI, int(rng.integers(lo_u, hi_u + 1))).tolist() for _ in range(turns)],
                    "osl": [int(rng.integers(lo_o, hi_o + 1)) for _ in range(turns)],
                    "think": [float(rng.exponential(args.think_s)) for _ in range(turns)]})
    return out


def mooncake_sessions(args) -> list[dict]:
    """The trace rows with a session id each (the earliest row sharing >= 2 leading hash-id blocks)."""
    rows = []
    with TRACE.open() as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) >= args.trace_requests:
                break
    prefixes: dict[tuple, int] = {}
    sessions, n = [], 0
    for r in rows:
        h = tuple(r["hash_ids"])
        sid = next((prefixes[h[:k]] for k in range(len(h), 1, -1) if h[:k] in prefixes), None)
        if sid is None:
            sid, n = n, n + 1
        sessions.append(sid)
        for k in range(2, len(h) + 1):
            prefixes.setdefault(h[:k], sid)
    wl = trace_workload(TRACE, args.trace_requests, args.compression, args.osl_scale)
    for w, sid in zip(wl, sessions):
        w["session"] = f"m{sid}"
    return wl


# ---------------------------------------------------------------- clients

async def stream_once(client: httpx.AsyncClient, url: str, body: dict, session: str) -> dict:
    """One streamed completion: TTFT (wall s), the generated token ids, the worker that served it."""
    t0 = time.perf_counter()
    res = {"ok": False, "ttft_s": None, "ids": [], "worker": None, "error": None}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers={"x-session-id": session}) as resp:
            res["worker"] = resp.headers.get("x-kvyard-worker")
            if resp.status_code != 200:
                res["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            buf = b""
            async for chunk in resp.aiter_raw():
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    if not ev.startswith(b"data: {"):
                        continue
                    data = json.loads(ev[6:])
                    for ch in data.get("choices") or ():
                        if res["ttft_s"] is None:
                            res["ttft_s"] = time.perf_counter() - t0
                        res["ids"].extend(ch.get("token_ids") or ())
        res["ok"] = res["ttft_s"] is not None
    except (httpx.HTTPError, ValueError) as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
    return res


async def run_synthetic(url: str, sessions: list[dict], speedup: float) -> list[dict]:
    """Each session's turns in order, with their think times; sessions overlap. Times: profile s / speed-up = wall."""
    out: list[dict] = []
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def session(s: dict) -> None:
            await asyncio.sleep(max(0.0, t0 + s["start"] / speedup - time.perf_counter()))
            history = list(s["system"])
            for k, user in enumerate(s["users"]):
                history += user
                body = {"model": MODEL, "prompt": history, "max_tokens": s["osl"][k], "stream": True, "ignore_eos": True,
                        "return_token_ids": True, "stream_options": {"include_usage": True}}
                r = await stream_once(client, url, body, s["id"])
                out.append({"session": s["id"], "turn": k, **{x: r[x] for x in ("ok", "ttft_s", "worker", "error")}})
                if not r["ok"]:
                    return
                history += r["ids"]
                await asyncio.sleep(s["think"][k] / speedup)

        await asyncio.gather(*(session(s) for s in sessions))
    return out


async def run_trace(url: str, workload: list[dict], speedup: float) -> list[dict]:
    out: list[dict] = []
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def fire(i: int, w: dict) -> None:
            await asyncio.sleep(max(0.0, t0 + w["t"] / speedup - time.perf_counter()))
            body = {"model": MODEL, "prompt": w["prompt"], "max_tokens": w["max_tokens"], "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            r = await stream_once(client, url, body, w["session"])
            out.append({"i": i, "session": w["session"], **{x: r[x] for x in ("ok", "ttft_s", "worker", "error")}})

        await asyncio.gather(*(fire(i, w) for i, w in enumerate(workload)))
    return out


def moves(results: list[dict], key: str) -> tuple[int, int]:
    """(turns served by another worker than their session's previous turn, turns that had a previous turn)."""
    last: dict[str, str] = {}
    moved = follow = 0
    for r in sorted(results, key=lambda r: r[key]):
        if not r["ok"]:
            continue
        prev = last.get(r["session"])
        if prev is not None:
            follow += 1
            moved += prev != r["worker"]
        last[r["session"]] = r["worker"]
    return moved, follow


async def one_run(args, load: str, policy: str, affinity: bool, work, tmp: Path, tag: str) -> dict:
    label = f"{policy}+affinity" if affinity else policy
    print(f"[{tag}] {load} {label}: starting {args.workers} workers…", flush=True)
    async with SessionCluster(args, policy, affinity, tmp, f"{load}-{label}-{tag}".replace(" ", "").replace("/", "of")) as cl:
        url = f"http://127.0.0.1:{args.port}"
        async with httpx.AsyncClient(timeout=10) as c:
            before = await engine_counters(c, cl.ports)
            la0 = os.getloadavg()[0]
            t0 = time.perf_counter()
            results = await (run_synthetic(url, work, args.speedup) if load == "synthetic" else run_trace(url, work, args.speedup))
            wall = time.perf_counter() - t0
            await asyncio.sleep(1.5)
            after = await engine_counters(c, cl.ports)
            sessions = (await c.get(url + "/api/cluster")).json().get("sessions")
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft_s"] * 1000 * args.speedup for r in ok]
    dh, dq = after["hits"] - before["hits"], after["queries"] - before["queries"]
    moved, follow = moves(results, "turn" if load == "synthetic" else "i")
    run = {"label": label, "requests": len(results), "errors": len(results) - len(ok),
           "error_samples": [r["error"] for r in results if not r["ok"]][:3], "wall_s": round(wall, 1),
           "ttft_ms": percentiles(ttft), "hit_rate": round(dh / dq, 4) if dq else None, "moved_turns": moved, "follow_turns": follow,
           "affinity_outcomes": (sessions or {}).get("outcomes") if affinity else None,
           "loadavg": [round(la0, 2), round(os.getloadavg()[0], 2)]}
    print(f"[{tag}] {load} {label}: TTFT {run['ttft_ms']} hit {run['hit_rate']} moved {moved}/{follow} errors {run['errors']}", flush=True)
    return run


def write_report(out: dict, cmd: str) -> None:
    lines = ["# Session affinity vs kv alone (multi-turn loads)", "",
             f"Command: `{cmd}`  ", f"When: {out['when']}; {out['machine']}; other engineers' work shared the machine "
             f"(load average {out['loadavg']['start']} at start, {out['loadavg']['end']} at the end), so compare the two runs of one round.", "",
             "TTFT in profile ms (wall × speed-up); hit rate = Δ prefix-cache hits / Δ queries over all engines; moved = turns served "
             "by another worker than the session's previous turn.", ""]
    for load, sec in out["loads"].items():
        lines += [f"## {load}", "", "```", json.dumps(sec["params"]), "```", "",
                  "| round | run | TTFT p50 | TTFT p90 | TTFT p99 | hit rate | moved / follow-up turns | errors | affinity outcomes |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for i, rnd in enumerate(sec["rounds"], 1):
            for r in rnd:
                t = r["ttft_ms"]
                lines.append(f"| {i} | {r['label']} | {t['p50']:.0f} | {t['p90']:.0f} | {t['p99']:.0f} | {100 * (r['hit_rate'] or 0):.1f}% | "
                             f"{r['moved_turns']} / {r['follow_turns']} | {r['errors']} | {r['affinity_outcomes'] or '–'} |")
        lines.append("")
        for pol, cmp in sec["compare"].items():
            lines.append(f"- {pol}: TTFT p90 with affinity / without, per round: {cmp['p90_ratio']}; hit rate with minus without "
                         f"(points), per round: {cmp['hit_delta_pts']}")
        lines.append("")
    (RESULTS / "affinity.md").write_text("\n".join(lines))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", default="synthetic,mooncake")
    ap.add_argument("--policies", default="kv,round-robin", help="each run without and with affinity")
    add_cluster_args(ap, workers=4, speedup=0.5, max_model_len=16384, num_gpu_blocks=2048, port=18790)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--sessions", type=int, default=96)
    ap.add_argument("--session-rate", type=float, default=8.0, help="sessions started per profile second")
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--turns", default="3,8")
    ap.add_argument("--user-tokens", default="128,768")
    ap.add_argument("--osl", default="64,256")
    ap.add_argument("--think-s", type=float, default=1.0, help="mean think time between turns, profile s")
    ap.add_argument("--trace-requests", type=int, default=400)
    ap.add_argument("--trace-policies", default="kv", help="mooncake load: each run without and with affinity")
    ap.add_argument("--trace-speedup", type=float, default=1.0, help="sim speed-up for the mooncake load")
    ap.add_argument("--trace-num-gpu-blocks", type=int, default=16384, help="per worker, mooncake load (its prompts reach 120k tokens)")
    ap.add_argument("--trace-max-model-len", type=int, default=131072)
    ap.add_argument("--compression", type=float, default=1.5)
    ap.add_argument("--osl-scale", type=float, default=0.25)
    return ap


async def amain(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvyard-affinity-"))
    args.engine_extra = []
    out = {**result_header("affinity"), "params": vars(args).copy(), "loads": {}}
    base = args
    for load in filter(None, base.loads.split(",")):
        args = base
        if load == "mooncake":
            args = argparse.Namespace(**{**vars(base), "num_gpu_blocks": base.trace_num_gpu_blocks, "max_model_len": base.trace_max_model_len,
                                         "policies": base.trace_policies, "speedup": base.trace_speedup})
        if load == "synthetic":
            work = synthetic_sessions(args)
            params = {"sessions": len(work), "turns": sum(len(s["users"]) for s in work), "session_rate": args.session_rate,
                      "system_prompts": args.system_prompts, "system_tokens": args.system_tokens, "think_s": args.think_s}
        else:
            work = mooncake_sessions(args)
            params = {"requests": len(work), "sessions": len({w["session"] for w in work}), "compression": args.compression,
                      "osl_scale": args.osl_scale, "multi_turn_sessions": sum(1 for s in {w["session"] for w in work}
                                                                            if sum(w["session"] == s for w in work) > 1)}
        params.update({"workers": args.workers, "num_gpu_blocks": args.num_gpu_blocks, "speedup": args.speedup,
                       "max_model_len": args.max_model_len})
        policies = [p for p in args.policies.split(",") if p]
        rounds = []
        for rnd in range(args.repeats):
            runs = []
            for policy in policies:
                for affinity in ((False, True) if rnd % 2 == 0 else (True, False)):  # alternate who goes first
                    runs.append(await one_run(args, load, policy, affinity, work, tmp, f"round {rnd + 1}/{args.repeats}"))
            rounds.append(runs)
        compare = {}
        for policy in policies:
            pairs = [({r["label"]: r for r in rnd}[policy], {r["label"]: r for r in rnd}[f"{policy}+affinity"]) for rnd in rounds]
            compare[policy] = {"p90_ratio": [round(b["ttft_ms"]["p90"] / a["ttft_ms"]["p90"], 3) for a, b in pairs],
                               "hit_delta_pts": [round(100 * ((b["hit_rate"] or 0) - (a["hit_rate"] or 0)), 2) for a, b in pairs]}
        out["loads"][load] = {"params": params, "rounds": rounds, "compare": compare}
    out["loadavg"]["end"] = round(os.getloadavg()[0], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = asyncio.run(amain(args))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "affinity.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    write_report(out, "python benchmarks/affinity.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"wrote {RESULTS / 'affinity.json'} and affinity.md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
