"""Priority and fair share in the admission queue vs FIFO: one tenant floods, a polite one and a high-priority one don't.

    .venv/bin/python benchmarks/fairshare.py [--duration 60 --repeats 2 ...]

A `kvyard up` cluster of `--workers` sim engines whose frontend admits at most `--max-inflight` requests at once
(frontend.max_inflight_per_model), so requests beyond that wait in the frontend's admission queue, and which
requires API keys (a key file made here):
  flood   priority normal, weight 1: `--flood-concurrency` closed-loop streams, each sending its next request as
          soon as the last ends (always more waiting than the fleet admits)
  polite  priority normal, weight 1: Poisson arrivals at `--polite-rate` requests per second
  vip     priority high, weight 1: Poisson arrivals at `--vip-rate` requests per second
All send `--prompt-tokens` random token ids and ask for `--osl` tokens (ignore_eos), streamed, for `--duration`
seconds. Two configurations per round, on fresh clusters, the same traffic:
  fifo        frontend.fair_share.enabled false: one FIFO queue (kvyard before this feature)
  fair-share  enabled (the default): classes in priority order, weighted fair share across keys within a class
Reported per tenant: TTFT p50/p90/p99 (ms, queueing in the frontend included), requests finished, errors (a
request that waits longer than the admission timeout gets a 503); and the deepest admission queue per class seen
on /api/cluster. Writes benchmarks/results/fairshare.json and fairshare.md. The sim runs at `--speedup` (1: the
H200 profile's own step times). Other work shares the machine: compare the two runs of one round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import add_cluster_args, result_header  # noqa: E402
from benchmarks.loadgen import percentiles  # noqa: E402
from benchmarks.routing import MODEL, Cluster  # noqa: E402
from orchestrator.security import KeyFile, generate_key, save_key_file  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TENANTS = {"flood": ("normal", 1.0), "polite": ("normal", 1.0), "vip": ("high", 1.0)}


def make_keys(folder: Path) -> tuple[Path, dict[str, str]]:
    keys, records = {}, []
    for name, (cls, weight) in TENANTS.items():
        key, rec = generate_key(name, priority=cls, weight=weight)
        keys[name] = key
        records.append(rec)
    path = folder / "keys.yaml"
    save_key_file(path, KeyFile(keys=records))
    return path, keys


class AdmissionCluster(Cluster):
    def __init__(self, args, fair: bool, keys_file: Path, tmp: Path, tag: str) -> None:
        frontend = {"security": {"api_keys_file": str(keys_file)}, "fair_share": {"enabled": fair},
                    "admission": {"max_inflight_per_model": args.max_inflight, "max_queued_per_model": 4096, "timeout_s": args.admission_timeout}}
        self.setup(args, "kv", tmp, tag, args.num_gpu_blocks, ["--workers", str(args.workers)], frontend)


async def one(client: httpx.AsyncClient, url: str, key: str, prompt: list[int], osl: int) -> dict:
    t0 = time.perf_counter()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": osl, "stream": True, "ignore_eos": True}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}) as resp:
            if resp.status_code != 200:
                return {"ok": False, "error": f"HTTP {resp.status_code}", "ttft_s": None}
            ttft = None
            async for chunk in resp.aiter_raw():
                if ttft is None and b'"choices":[{' in chunk:
                    ttft = time.perf_counter() - t0
            return {"ok": ttft is not None, "ttft_s": ttft, "error": None}
    except httpx.HTTPError as exc:
        return {"ok": False, "error": type(exc).__name__, "ttft_s": None}


async def traffic(args, url: str, keys: dict[str, str], seed: int) -> tuple[dict[str, list[dict]], dict]:
    rng = random.Random(seed)
    out: dict[str, list[dict]] = {name: [] for name in TENANTS}
    deepest: dict[str, int] = {}
    end = time.perf_counter() + args.duration
    limits = httpx.Limits(max_connections=args.flood_concurrency + 200, max_keepalive_connections=args.flood_concurrency + 50)

    def prompt() -> list[int]:
        return [rng.randrange(1000, 100000) for _ in range(args.prompt_tokens)]

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def flood() -> None:
            while time.perf_counter() < end:
                out["flood"].append(await one(client, url, keys["flood"], prompt(), args.osl))

        async def poisson(name: str, rate: float) -> None:
            tasks = []
            while True:
                await asyncio.sleep(rng.expovariate(rate))
                if time.perf_counter() >= end:
                    break
                tasks.append(asyncio.create_task(one(client, url, keys[name], prompt(), args.osl)))
            out[name].extend(await asyncio.gather(*tasks))

        async def watch() -> None:
            while time.perf_counter() < end:
                try:
                    adm = (await client.get(url + "/api/cluster")).json().get("admission", {}).get(MODEL, {})
                    for cls, depth in (adm.get("queued") or {}).items():
                        deepest[cls] = max(deepest.get(cls, 0), depth)
                except (httpx.HTTPError, ValueError):
                    pass
                await asyncio.sleep(0.5)

        await asyncio.gather(*(flood() for _ in range(args.flood_concurrency)), poisson("polite", args.polite_rate),
                             poisson("vip", args.vip_rate), watch())
    return out, deepest


async def one_run(args, fair: bool, keys_file: Path, keys: dict[str, str], tmp: Path, tag: str, seed: int) -> dict:
    label = "fair-share" if fair else "fifo"
    print(f"[{tag}] {label}: starting {args.workers} workers…", flush=True)
    async with AdmissionCluster(args, fair, keys_file, tmp, f"{label}-{tag}".replace(" ", "").replace("/", "of")):
        la0 = os.getloadavg()[0]
        results, deepest = await traffic(args, f"http://127.0.0.1:{args.port}", keys, seed)
    run = {"label": label, "deepest_queue": deepest, "loadavg": [round(la0, 2), round(os.getloadavg()[0], 2)], "tenants": {}}
    for name, rs in results.items():
        ok = [r for r in rs if r["ok"]]
        run["tenants"][name] = {"requests": len(rs), "ok": len(ok), "errors": len(rs) - len(ok),
                                "ttft_ms": percentiles([r["ttft_s"] * 1000 for r in ok])}
    print(f"[{tag}] {label}: " + "; ".join(f"{n} p90 {t['ttft_ms']['p90']} ok {t['ok']}/{t['requests']}" for n, t in run["tenants"].items())
          + f"; deepest queue {deepest}", flush=True)
    return run


def write_report(out: dict, cmd: str) -> None:
    lines = ["# Priority and fair share vs FIFO admission (one tenant flooding)", "", f"Command: `{cmd}`  ",
             f"When: {out['when']}; {out['machine']}; other engineers' work shared the machine (load average "
             f"{out['loadavg']['start']} at start, {out['loadavg']['end']} at the end): compare the two runs of one round.", "",
             "```", json.dumps(out["setup"]), "```", "",
             "TTFT in ms from the client, queueing in the frontend's admission queue included.", "",
             "| round | admission | tenant | class | TTFT p50 | TTFT p90 | TTFT p99 | finished | errors |", "|---|---|---|---|---|---|---|---|---|"]
    for i, rnd in enumerate(out["rounds"], 1):
        for run in rnd:
            for name, t in run["tenants"].items():
                q = t["ttft_ms"]
                fmt = (lambda v: "–" if v is None else f"{v:,.0f}")
                lines.append(f"| {i} | {run['label']} | {name} | {TENANTS[name][0]} | {fmt(q['p50'])} | {fmt(q['p90'])} | {fmt(q['p99'])} | "
                             f"{t['ok']} | {t['errors']} |")
    lines += ["", "Deepest admission queue per class seen (sampled every 0.5 s): "
              + "; ".join(f"round {i} {run['label']} {run['deepest_queue']}" for i, rnd in enumerate(out["rounds"], 1) for run in rnd), ""]
    for name in ("polite", "vip"):
        lines.append(f"- {name} TTFT p90, fair-share / fifo, per round: {out['ratios'][name]}")
    lines.append("")
    (RESULTS / "fairshare.md").write_text("\n".join(lines))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_args(ap, workers=2, speedup=1.0, max_model_len=8192, num_gpu_blocks=8192, port=18690)
    ap.add_argument("--max-inflight", type=int, default=8, help="frontend admission slots per model")
    ap.add_argument("--admission-timeout", type=float, default=60.0)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of traffic per run")
    ap.add_argument("--flood-concurrency", type=int, default=64)
    ap.add_argument("--polite-rate", type=float, default=1.0)
    ap.add_argument("--vip-rate", type=float, default=1.0)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--osl", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    return ap


async def amain(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvyard-fairshare-"))
    args.engine_extra = []
    keys_file, keys = make_keys(tmp)
    out = {**result_header("fairshare"), "setup": {k: v for k, v in vars(args).items() if k != "engine_extra"}, "tenants": TENANTS,
           "rounds": []}
    for rnd in range(args.repeats):
        order = (False, True) if rnd % 2 == 0 else (True, False)
        runs = [await one_run(args, fair, keys_file, keys, tmp, f"round {rnd + 1}/{args.repeats}", seed=100 + rnd) for fair in order]
        out["rounds"].append(sorted(runs, key=lambda r: r["label"] != "fifo"))
    out["ratios"] = {name: [round(fair["tenants"][name]["ttft_ms"]["p90"] / fifo["tenants"][name]["ttft_ms"]["p90"], 3)
                            if fair["tenants"][name]["ttft_ms"]["p90"] and fifo["tenants"][name]["ttft_ms"]["p90"] else None
                            for fifo, fair in out["rounds"]] for name in ("polite", "vip", "flood")}
    out["loadavg"]["end"] = round(os.getloadavg()[0], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = asyncio.run(amain(args))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fairshare.json").write_text(json.dumps(out, indent=1) + "\n")
    write_report(out, "python benchmarks/fairshare.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"wrote {RESULTS / 'fairshare.json'} and fairshare.md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
