"""kvyard side by side with NVIDIA Dynamo: the same workload, rate and load generator through both stacks.

    scripts/install_dynamo.sh                  # once: Dynamo 1.6.1 in .venv-dynamo (not part of make test)
    .venv/bin/python benchmarks/dynamo_compare.py [--requests 500 --compression 6 --speedup 0.25 ...]

Stacks, 8 workers each, 16-token blocks, the same KV capacity per worker, the same H200 Llama-3.1-8B-FP8
profile (measured by Dynamo's profiler; kvyard's sim bundles the same data):
  kvyard   `kvyard up --policy {round-robin,kv}` over sim engines (benchmarks/routing.py's Cluster).
  Dynamo   `python -m dynamo.mocker --num-workers 8 --planner-profile-data perf_data.npz` and
           `python -m dynamo.frontend --router-mode {round-robin,kv}`, file discovery, TCP request plane,
           ZMQ event plane: no etcd, no NATS. The profile is
           converted by Dynamo's own converter (dynamo.mocker.utils.planner_profiler_perf_data_converter)
           with a stand-in `aisimulate_core` package on PYTHONPATH (the real one is not on PyPI; the
           conversion only uses Dynamo's regression code).
Both get the same requests (token ids, so no tokenizer differs), on the same open-loop schedule, from the
same client (benchmarks/routing.py's replay over benchmarks/loadgen.py), with the same speed-up (engine
step times divided by it; all latencies are reported in profile time = wall × speed-up).

Workloads (one run does both, every stack fresh for every run):
  trace   the first --requests rows of the Mooncake conversation trace, arrivals compressed --compression×
  shared  --sp-prefixes prefixes × --sp-prefix-tokens tokens, + --sp-suffix-tokens unique tokens, OSL
          --sp-osl, Poisson --sp-rate req/s: prefixes fit the fleet's cache but not one worker's.

Per workload: first round-robin through both, to check the engines agree (TTFT p50 and p90 within
--agree-tolerance, 15%); then the kv routers: TTFT p50/p90 and the fleet's prompt-cache hit rate.
Hit rates: kvyard from the engines' vllm:prefix_cache_{hits,queries}_total, Dynamo from its frontend's
dynamo_frontend_cached_tokens_sum / dynamo_frontend_input_sequence_tokens_sum (the mocker's cached
tokens per request); both count the engine's reused prompt tokens over all prompt tokens.

Hit path: --hit-pairs cold/hot pairs per stack, one request at a time through the kv router: a prefix + a
suffix, then the same prefix + another suffix. The round-robin agreement check compares mostly cold prefills;
this shows how each engine times a prefill whose prefix is cached, which the kv comparison depends on.

Writes benchmarks/results/dynamo_compare.json, .md and .png (--out to rename).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import reap_group  # noqa: E402
from benchmarks.loadgen import percentiles  # noqa: E402
from benchmarks.routing import (TRACE, Cluster, engine_counters, hit_bars, median_run, replay, shared_prefix_workload,  # noqa: E402
                                trace_workload, ttft_cdf_axes, ttft_cdf_lines)

RESULTS = ROOT / "benchmarks" / "results"
OUT = "dynamo_compare"
MODEL = "kvyard-sim"
DYNAMO_VENV = ROOT / ".venv-dynamo"
SIM_TOKENIZER = ROOT / "workers" / "sim" / "tokenizer"
H200_PROFILE = "dynamo/planner/tests/data/profiling_results/H200_TP1P_TP1D"  # inside the ai-dynamo wheel

# A Llama-3.1-8B-like config around the sim's cl100k tokenizer: the mocker reads only the tokenizer and
# the context length from the model folder (the step times come from the profile).
MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                "vocab_size": 100256, "max_position_embeddings": 131072, "bos_token_id": 100257, "eos_token_id": 100257,
                "torch_dtype": "bfloat16"}

# Stand-in for aisimulate_core (not installable from PyPI): any attribute is an inert class, enough for the
# imports along the converter's path, which never calls into it.
STANDIN = '''def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (), {"__init__": lambda self, *a, **k: None})
'''


# ---------------------------------------------------------------- helpers (unit-tested)

def prepare_model_dir(dest: Path, tokenizer_dir: Path = SIM_TOKENIZER) -> Path:
    """A model folder Dynamo accepts: tokenizer.json, a config.json and a tokenizer_config.json that carries
    the chat template inline (Dynamo's frontend refuses a model without `chat_template` in it)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_dir / "tokenizer.json", dest / "tokenizer.json")
    tcfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    template = tokenizer_dir / "chat_template.jinja"
    if "chat_template" not in tcfg and template.is_file():
        tcfg["chat_template"] = template.read_text()
    (dest / "tokenizer_config.json").write_text(json.dumps(tcfg))
    (dest / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return dest


def write_standin(dest: Path) -> Path:
    """The stand-in `aisimulate_core` package (with .sdk and ._native) under dest; returns dest for PYTHONPATH."""
    pkg = dest / "aisimulate_core"
    pkg.mkdir(parents=True, exist_ok=True)
    for mod in ("__init__", "sdk", "_native"):
        (pkg / f"{mod}.py").write_text(STANDIN)
    return dest


def prom_sum(text: str, name: str) -> float:
    """Sum of every sample of a Prometheus metric (any labels) in an exposition text; 0 when absent."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+|NaN)$", text, re.M):
        v = float(m.group(1))
        if v == v:
            total += v
    return total


def count_generate_instances(root: Path) -> int:
    """Instances of Dynamo's `generate` endpoint in a file-discovery folder (DYN_FILE_KV)."""
    inst = root / "v1" / "instances"
    if not inst.is_dir():
        return 0
    return sum(1 for p in inst.iterdir() if p.is_file() and unquote(p.name).split("/")[-2:-1] == ["generate"])


def agreement(a: dict, b: dict, tolerance: float) -> dict:
    """Do two round-robin runs agree? TTFT p50 and p90 ratios b/a, each within 1 ± tolerance."""
    out = {"tolerance": tolerance}
    for q in ("p50", "p90"):
        x, y = a["ttft_ms"][q], b["ttft_ms"][q]
        out[f"ttft_{q}_ratio"] = round(y / x, 3) if x and y else None
    out["agree"] = all(r is not None and abs(r - 1) <= tolerance for r in (out["ttft_p50_ratio"], out["ttft_p90_ratio"]))
    return out


# ---------------------------------------------------------------- Dynamo

def dynamo_python() -> str:
    py = DYNAMO_VENV / "bin" / "python"
    if not py.exists():
        raise SystemExit(f"{py} not found: run scripts/install_dynamo.sh first")
    return str(py)


def convert_profile(tmp: Path) -> Path:
    """The H200 profile as the mocker's perf_data.npz, through Dynamo's converter (once per run)."""
    out = tmp / "perf"
    npz = out / "perf_data.npz"
    if npz.exists():
        return npz
    py = dynamo_python()
    site = subprocess.run([py, "-c", "import dynamo, os; print(os.path.dirname(list(dynamo.__path__)[0]))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    env = dict(os.environ, PYTHONPATH=str(write_standin(tmp / "standin")))
    proc = subprocess.run([py, "-m", "dynamo.mocker.utils.planner_profiler_perf_data_converter", "--profile_results_dir",
                           str(Path(site) / H200_PROFILE), "--output_dir", str(out)], env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not npz.exists():
        raise RuntimeError(f"Dynamo's profile converter failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return npz


def mocker_profile(tmp: Path, npz: Path) -> Path:
    """kvyard's sim on the mocker's terms: the bundled H200 profile with its prefill curve replaced by the one Dynamo's
    converter wrote for the mocker (`perf_data.npz`), for `--prefill-pricing new-tokens` (workers/sim/timing.py)."""
    from workers.sim.profiles import BUNDLED, DEFAULT_PROFILE, PROFILES_DIR

    src = PROFILES_DIR / BUNDLED[DEFAULT_PROFILE][0]
    dest = tmp / "kvyard-mocker-profile"
    shutil.copytree(src, dest, dirs_exist_ok=True)
    with np.load(npz) as m, np.load(src / "prefill.npz") as ours:
        arrays = {k: ours[k] for k in ours.files}
        isl, ttft = np.asarray(m["prefill_isl"], dtype=float), np.asarray(m["prefill_ttft_ms"], dtype=float)
    arrays["prefill_isl"], arrays["prefill_ttft"] = isl.reshape(1, -1), ttft.reshape(1, -1)
    arrays["prefill_thpt_per_gpu"] = (isl / np.maximum(ttft, 1e-9) * 1000.0).reshape(1, -1)
    np.savez(dest / "prefill.npz", **arrays)
    return dest


class DynamoCluster:
    """Dynamo's mocker (N workers in one process) + frontend, each in its own session, stopped by PID group."""

    def __init__(self, args, router_mode: str, num_gpu_blocks: int, tmp: Path) -> None:
        self.args, self.router_mode = args, router_mode
        self.url = f"http://127.0.0.1:{args.dynamo_port}"
        tag = f"dynamo-{router_mode}-{num_gpu_blocks}"
        self.dir = tmp / tag
        self.dir.mkdir(parents=True, exist_ok=True)
        model = prepare_model_dir(tmp / "dynamo-model")
        npz = convert_profile(tmp)
        host = "127.0.0.1"
        self.env = dict(os.environ, DYN_TCP_RPC_HOST=host, DYN_EVENT_PLANE_HOST=host, DYN_TCP_RESPONSE_STREAM_HOST=host,
                        DYN_SYSTEM_HOST=host, DYN_FILE_KV=str(self.dir / "discovery"), DYN_LOG="warn")
        common = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
        py = dynamo_python()
        self.mocker_cmd = [py, "-m", "dynamo.mocker", "--model-path", str(model), "--model-name", MODEL,
                           "--num-workers", str(args.workers), "--block-size", str(args.block_size),
                           "--num-gpu-blocks-override", str(num_gpu_blocks), "--max-model-len", str(args.max_model_len),
                           "--speedup-ratio", str(args.speedup), "--planner-profile-data", str(npz), *common]
        self.frontend_cmd = [py, "-m", "dynamo.frontend", "--http-host", host, "--http-port", str(args.dynamo_port),
                             "--router-mode", router_mode, *common]
        self.procs: list[subprocess.Popen] = []

    def _spawn(self, cmd: list[str], name: str) -> None:
        self.procs.append(subprocess.Popen(cmd, cwd=self.dir, env=self.env, stdout=open(self.dir / f"{name}.log", "wb"),
                                           stderr=subprocess.STDOUT, start_new_session=True))

    async def __aenter__(self) -> "DynamoCluster":
        self._spawn(self.mocker_cmd, "mocker")
        self._spawn(self.frontend_cmd, "frontend")
        deadline = time.monotonic() + 180
        async with httpx.AsyncClient(timeout=5) as c:
            while time.monotonic() < deadline:
                if any(p.poll() is not None for p in self.procs):
                    break
                try:
                    models = (await c.get(self.url + "/v1/models")).json()["data"]
                    if any(m["id"] == MODEL for m in models) and self.registered() >= self.args.workers:
                        await asyncio.sleep(2.0)  # let the router connect every worker's event stream
                        return self
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                await asyncio.sleep(0.5)
        await self.__aexit__(None, None, None)
        logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in self.dir.glob("*.log"))
        raise RuntimeError(f"Dynamo ({self.router_mode}) did not come up with {self.args.workers} workers:\n{logs}")

    def registered(self) -> int:
        """Worker instances registered in the file discovery: one file per worker of the generate endpoint,
        named URL-encoded, e.g. v1/instances/dynamo%2Fbackend%2Fgenerate%2F<instance id>."""
        return count_generate_instances(self.dir / "discovery")

    async def __aexit__(self, *exc) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            await reap_group(p)

    async def counters(self, client: httpx.AsyncClient) -> dict:
        text = (await client.get(self.url + "/metrics")).text
        return {"hits": prom_sum(text, "dynamo_frontend_cached_tokens_sum"),
                "queries": prom_sum(text, "dynamo_frontend_input_sequence_tokens_sum")}


# ---------------------------------------------------------------- runs

async def run_one(args, stack: str, policy: str, workload: list[dict], num_gpu_blocks: int, tmp: Path, label: str,
                  sequential: bool = False) -> dict:
    print(f"[{label}] {stack} {policy}: starting {args.workers} workers…", flush=True)
    if stack == "dynamo":
        cluster = DynamoCluster(args, policy, num_gpu_blocks, tmp)
        url = cluster.url
    else:
        cluster = Cluster(args, policy, num_gpu_blocks, tmp)
        url = f"http://127.0.0.1:{args.port}"
    async with cluster as cl, httpx.AsyncClient(timeout=10) as c:
        async def counters() -> dict:
            return await cl.counters(c) if stack == "dynamo" else await engine_counters(c, cl.ports)

        before = await counters()
        la0 = os.getloadavg()[0]
        res = await replay(url, workload, args.speedup, sequential)
        await asyncio.sleep(1.5)  # last metrics
        after = await counters()
    dh, dq = after["hits"] - before["hits"], after["queries"] - before["queries"]
    res.update({"stack": stack, "policy": policy, "num_gpu_blocks": num_gpu_blocks, "cache_hits_tokens": dh,
                "cache_queries_tokens": dq, "hit_rate": round(dh / dq, 4) if dq else None,
                "loadavg_start": round(la0, 2), "loadavg_end": round(os.getloadavg()[0], 2)})
    print(f"[{label}] {stack} {policy}: TTFT {res['ttft_ms']} hit rate {res['hit_rate']} ok {res['ok']}/{res['requests']} "
          f"errors {res['errors']} {res['error_samples'][:1]}", flush=True)
    return res


async def compare(args, workload: list[dict], num_gpu_blocks: int, tmp: Path, label: str) -> dict:
    """Unloaded (one request at a time), then rr through both (interleaved, so both see the same box), the
    agreement check, then kv through both."""
    runs: dict[str, dict] = {}
    unloaded: dict[str, dict] = {}
    if args.unloaded_requests:
        light = [dict(w, max_tokens=1) for w in workload[: args.unloaded_requests]]
        for stack in ("kvyard", "dynamo"):
            unloaded[stack] = await run_one(args, stack, "round-robin", light, num_gpu_blocks, tmp, label + " unloaded", sequential=True)
    rounds: dict[str, list[dict]] = {}
    for rnd in range(max(1, args.repeats)):  # round by round, so a slow spell of the box hits both stacks
        tag = label if args.repeats <= 1 else f"{label} round {rnd + 1}/{args.repeats}"
        for policy in ("round-robin", "kv"):
            for stack in ("kvyard", "dynamo"):
                rounds.setdefault(f"{stack} {policy}", []).append(
                    await run_one(args, stack, policy, workload, num_gpu_blocks, tmp, tag))
    runs = {name: median_run(rs) for name, rs in rounds.items()}  # one round: that run; more: medians
    sec = {"runs": runs, "engines_agree": agreement(runs["kvyard round-robin"], runs["dynamo round-robin"], args.agree_tolerance)}
    if args.repeats > 1:
        sec["rounds_agree"] = [agreement(a, b, args.agree_tolerance)
                               for a, b in zip(rounds["kvyard round-robin"], rounds["dynamo round-robin"])]
    if unloaded:
        sec["unloaded"] = unloaded
        sec["unloaded_agree"] = agreement(unloaded["kvyard"], unloaded["dynamo"], args.agree_tolerance)
    k, d = runs["kvyard kv"], runs["dynamo kv"]
    sec["kv_kvyard_over_dynamo"] = {
        "ttft_p50": round(k["ttft_ms"]["p50"] / d["ttft_ms"]["p50"], 3) if d["ttft_ms"]["p50"] else None,
        "ttft_p90": round(k["ttft_ms"]["p90"] / d["ttft_ms"]["p90"], 3) if d["ttft_ms"]["p90"] else None,
        "hit_rate": round(k["hit_rate"] / d["hit_rate"], 3) if d["hit_rate"] else None,
    }
    return sec


def hit_path_workload(n: int, prefix_tokens: int, suffix_tokens: int, seed: int = 11) -> list[dict]:
    """n pairs sent one at a time: prefix_i + suffix (cold), then prefix_i + another suffix (its prefix cached)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prefix = rng.integers(1000, 100000, prefix_tokens).tolist()
        for _ in range(2):
            out.append({"t": 0.0, "prompt": prefix + rng.integers(1000, 100000, suffix_tokens).tolist(), "max_tokens": 1})
    return out


async def hit_path(args, tmp: Path) -> dict:
    """How each engine times a prefill whose prefix is cached: kv routing, idle fleet, cold/hot pairs."""
    wl = hit_path_workload(args.hit_pairs, args.sp_prefix_tokens, args.sp_suffix_tokens)
    sec = {"description": f"{args.hit_pairs} pairs, one request at a time, kv router: a {args.sp_prefix_tokens}-token prefix + "
                          f"{args.sp_suffix_tokens} unique tokens (cold), then the same prefix + other {args.sp_suffix_tokens} "
                          "tokens (hot: routed to the worker holding the prefix). max_tokens 1.", "runs": {}}
    for stack in ("kvyard", "dynamo"):
        r = await run_one(args, stack, "kv", wl, args.sp_num_gpu_blocks, tmp, "hit path", sequential=True)
        ttft = r.pop("_ttft_all")
        if r["ok"] == len(wl):
            r["cold_ttft_ms"] = percentiles(ttft[0::2])
            r["hot_ttft_ms"] = percentiles(ttft[1::2])
        sec["runs"][stack] = r
    return sec


# ---------------------------------------------------------------- report

def fmt(v, nd=1) -> str:
    return "–" if v is None else f"{v:,.{nd}f}"


def write_report(out: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    clean = json.loads(json.dumps(out, default=float))
    for sec in ("trace", "shared_prefix"):
        for r in [*clean.get(sec, {}).get("runs", {}).values(), *clean.get(sec, {}).get("unloaded", {}).values()]:
            r.pop("_ttft_all", None)
    (RESULTS / f"{OUT}.json").write_text(json.dumps(clean, indent=1))
    p = out["params"]
    L = ["# kvyard vs NVIDIA Dynamo 1.6.1: the same workloads through both stacks", "",
         f"Run {out['when']} on {out['machine']}; load average {out['loadavg']['start']} at start, {out['loadavg']['end']} at the end "
         "(the box is shared with other jobs). Latencies in the engines' profile time (H200 Llama-3.1-8B-FP8 profile; "
         f"wall × speed-up {p['speedup']}).", "", "```", out["command"], "```", "",
         f"Each stack: {p['workers']} workers, block size {p['block_size']}, fresh for every run. kvyard: `kvyard up` over sim "
         "engines. Dynamo: `dynamo.mocker` with the same profile (converted by Dynamo's own converter) + `dynamo.frontend`, "
         "file discovery, TCP request plane, ZMQ events. Same requests (token ids), same open-loop schedule, same client "
         "(benchmarks/loadgen.py). Hit rate = reused prompt tokens / prompt tokens over the fleet (kvyard: engines' "
         "prefix-cache counters; Dynamo: its frontend's cached-token and input-token sums).", ""]
    if p.get("kvyard_engine") == "mocker":
        L += ["**kvyard's engines on the mocker's terms** (`--kvyard-engine mocker`): kvyard's sim takes the prefill curve Dynamo's "
              "converter wrote for the mocker and prices each step's prefill by its new tokens only, as the mocker does "
              "(`--prefill-pricing new-tokens`; decode from the profile as before), so both stacks' engines charge a prefix "
              "hit alike and the rows compare the routers and frontends.", ""]
    for sec, title in (("trace", "Mooncake conversation trace"), ("shared_prefix", "Shared-prefix workload")):
        d = out.get(sec)
        if not d:
            continue
        L += [f"## {title}", "", d["description"], "",
              "| stack | router | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | req/s | cache hit rate | errors |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in d["runs"].values():
            t = r["ttft_ms"]
            L.append(f"| {r['stack']} | {r['policy']} | {fmt(t['p50'])} | {fmt(t['p90'])} | {fmt(t['p99'])} | "
                     f"{fmt(r['itl_ms']['p50'], 2)} | {fmt(r['req_per_s'], 2)} | "
                     f"{fmt(100 * r['hit_rate']) + '%' if r['hit_rate'] is not None else '–'} | {r['errors']} |")
        ag, kv = d["engines_agree"], d["kv_kvyard_over_dynamo"]
        if d.get("unloaded"):
            u, ua = d["unloaded"], d["unloaded_agree"]
            L += ["", f"Unloaded (round-robin, first {u['kvyard']['requests']} requests one at a time, max_tokens 1): TTFT p50/p90 "
                  f"kvyard {fmt(u['kvyard']['ttft_ms']['p50'])}/{fmt(u['kvyard']['ttft_ms']['p90'])} ms, Dynamo "
                  f"{fmt(u['dynamo']['ttft_ms']['p50'])}/{fmt(u['dynamo']['ttft_ms']['p90'])} ms (Dynamo/kvyard "
                  f"{fmt(ua['ttft_p50_ratio'], 3)}/{fmt(ua['ttft_p90_ratio'], 3)})."]
        if d.get("rounds_agree"):
            n = len(d["rounds_agree"])
            L += ["", f"Rows are medians over {n} rounds (the four runs once per round, a fresh stack each). Per round, "
                  "TTFT p90 ms / hit rate:"] + [
                f"- {name}: " + "; ".join(f"{fmt(x['ttft_ms']['p90'])} / {fmt(100 * x['hit_rate']) if x['hit_rate'] is not None else '–'}%"
                                          for x in r["rounds"]) for name, r in d["runs"].items()] + [
                "- round-robin p90, Dynamo/kvyard per round: " + ", ".join(fmt(a["ttft_p90_ratio"], 3) for a in d["rounds_agree"])]
        L += ["", f"Engines agree (round-robin, Dynamo/kvyard TTFT within ±{100 * ag['tolerance']:.0f}%): "
              f"p50 ratio {fmt(ag['ttft_p50_ratio'], 3)}, p90 ratio {fmt(ag['ttft_p90_ratio'], 3)} → **{'yes' if ag['agree'] else 'NO'}**.",
              f"kv routers, kvyard/Dynamo: TTFT p50 **{fmt(kv['ttft_p50'], 3)}×**, p90 **{fmt(kv['ttft_p90'], 3)}×** "
              f"(below 1: kvyard faster); hit rate **{fmt(kv['hit_rate'], 3)}×** (above 1: kvyard hits more).", ""]
    hp = out.get("hit_path")
    if hp:
        L += ["## Hit path: TTFT of a prefill whose prefix is cached", "", hp["description"], "",
              "| stack | cold TTFT p50 | cold p90 | hot TTFT p50 | hot p90 | cache hit rate |", "|---|---:|---:|---:|---:|---:|"]
        for stack, r in hp["runs"].items():
            c, h = r.get("cold_ttft_ms") or {}, r.get("hot_ttft_ms") or {}
            L.append(f"| {stack} | {fmt(c.get('p50'))} | {fmt(c.get('p90'))} | {fmt(h.get('p50'))} | {fmt(h.get('p90'))} | "
                     f"{fmt(100 * r['hit_rate']) + '%' if r['hit_rate'] is not None else '–'} |")
        L.append("")
    if out.get("notes"):
        L += ["## Notes", ""] + [f"- {n}" for n in out["notes"]] + [""]
    (RESULTS / f"{OUT}.md").write_text("\n".join(L))
    print("\n".join(L))
    plot(out)


def plot(out: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    secs = [s for s in ("trace", "shared_prefix") if s in out]
    if not secs:
        return
    fig, axes = plt.subplots(len(secs), 2, figsize=(12, 4.2 * len(secs)), squeeze=False)
    styles = {"kvyard": "-", "dynamo": "--"}
    colors = {"round-robin": "C1", "kv": "C0"}
    for row, sec in enumerate(secs):
        d = out[sec]
        ttft_cdf_lines(axes[row][0], [(name, r, {"linestyle": styles[r["stack"]], "color": colors[r["policy"]]})
                                      for name, r in d["runs"].items()])
        ttft_cdf_axes(axes[row][0], f"{sec.replace('_', ' ')}: TTFT")
        names = list(d["runs"])
        hit_bars(axes[row][1], names, [100 * (d["runs"][n]["hit_rate"] or 0) for n in names],
                 [colors[d["runs"][n]["policy"]] for n in names], f"{sec.replace('_', ' ')}: fleet cache hits", 15)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{OUT}.png", dpi=110)


# ---------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--speedup", type=float, default=0.25, help="engine step times divided by this, in both stacks")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--port", type=int, default=18490, help="kvyard frontend")
    ap.add_argument("--base-port", type=int, default=18500, help="kvyard's first engine")
    ap.add_argument("--dynamo-port", type=int, default=18480, help="Dynamo frontend")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--requests", type=int, default=500, help="first N requests of the trace")
    ap.add_argument("--compression", type=float, default=6.0, help="trace time / profile time")
    ap.add_argument("--osl-scale", type=float, default=0.25)
    ap.add_argument("--num-gpu-blocks", type=int, default=16384, help="per worker, trace")
    ap.add_argument("--sp-requests", type=int, default=384)
    ap.add_argument("--sp-prefixes", type=int, default=64)
    ap.add_argument("--sp-prefix-tokens", type=int, default=8192)
    ap.add_argument("--sp-suffix-tokens", type=int, default=256)
    ap.add_argument("--sp-osl", type=int, default=32)
    ap.add_argument("--sp-rate", type=float, default=20.0, help="req/s, profile time")
    ap.add_argument("--sp-num-gpu-blocks", type=int, default=16384)
    ap.add_argument("--agree-tolerance", type=float, default=0.15)
    ap.add_argument("--unloaded-requests", type=int, default=24, help="per workload and stack, one at a time (0: skip)")
    ap.add_argument("--hit-pairs", type=int, default=8, help="hit path: cold/hot pairs per stack")
    ap.add_argument("--skip", default="", help="comma list of: trace, shared, hitpath")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of the four loaded runs per workload; rows are medians")
    ap.add_argument("--kvyard-engine", choices=["profile", "mocker"], default="profile",
                    help="kvyard's sim prices prefill by the profile (default), or as the mocker does: Dynamo's converted "
                         "prefill curve, new tokens only (to compare the routers on one engine model)")
    ap.add_argument("--out", default="dynamo_compare", help="results/<out>.json, .md, .png")
    return ap


async def amain(args, command: str) -> dict:
    skip = set(filter(None, args.skip.split(",")))
    tmp = Path(tempfile.mkdtemp(prefix="kvyard-dyncmp-"))
    out: dict = {"benchmark": "dynamo_compare", "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "machine": f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}", "command": command,
                 "loadavg": {"start": round(os.getloadavg()[0], 2)},
                 "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "notes": []}
    npz = convert_profile(tmp)  # fail early if Dynamo is missing or its converter breaks
    if args.kvyard_engine == "mocker":
        args.engine_extra = ["--profile", str(mocker_profile(tmp, npz)), "--prefill-pricing", "new-tokens"]
    if "trace" not in skip:
        wl = trace_workload(args.trace, args.requests, args.compression, args.osl_scale)
        rate = len(wl) / wl[-1]["t"] if wl[-1]["t"] else None
        sec = await compare(args, wl, args.num_gpu_blocks, tmp, "trace")
        sec["description"] = (f"First {len(wl)} requests of the Mooncake conversation trace (benchmarks/data/), arrivals "
                              f"compressed {args.compression:g}×: {fmt(rate, 1)} req/s profile. {args.num_gpu_blocks} KV blocks per worker.")
        out["trace"] = sec
    if "shared" not in skip:
        wl = shared_prefix_workload(args.sp_requests, args.sp_prefixes, args.sp_prefix_tokens, args.sp_suffix_tokens,
                                    args.sp_osl, args.sp_rate)
        sec = await compare(args, wl, args.sp_num_gpu_blocks, tmp, "shared")
        sec["description"] = (f"{args.sp_prefixes} prefixes × {args.sp_prefix_tokens} tokens + {args.sp_suffix_tokens} unique, "
                              f"OSL {args.sp_osl}, {args.sp_requests} requests, Poisson {args.sp_rate:g} req/s profile; "
                              f"{args.sp_num_gpu_blocks} KV blocks per worker.")
        out["shared_prefix"] = sec
    if "hitpath" not in skip:
        out["hit_path"] = await hit_path(args, tmp)
    out["loadavg"]["end"] = round(os.getloadavg()[0], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    global OUT
    args = build_parser().parse_args(argv)
    OUT = args.out
    command = "benchmarks/dynamo_compare.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = asyncio.run(amain(args, command))
    write_report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
