"""Real vLLM-CPU P/D over NIXL, engines loose vs pinned with `--engine-cpus`: what the frontend and requests see.

    python benchmarks/pd_vllm_pinning.py [--requests 12] [--modes loose pinned]

vLLM's NixlConnector runs NIXL's UCX progress thread busy-polling (zero poll delay), a core per engine, idle or not.
On a small CPU host that leaves nothing for the frontend. Each mode starts the same stack (`kvyard up --backend
vllm`, 1 prefill + 1 decode with NixlConnector, float32, `--disagg-mode always --enforce-disagg`) and sends the same
greedy requests one after another (a prompt of 6 blocks + 7 tokens, 8 tokens out), then reads:
    latency        each request's wall time, and its status (503: the hand-off failed and disaggregation is enforced)
    loop stalls    the frontend's own `kvyard_event_loop_stalls_total` and lag histogram (orchestrator/loopwatch.py)
    lapsed leases  "had lapsed" lines in the frontend's log (local workers missed a renewal)
    host           load average at the end, and the engines' CPU seconds
`pinned` puts both engines on every CPU but the first (needs 2+); `loose` lets them run anywhere (the default).
The modes run back to back on one machine. Needs the vLLM venv (`make vllm`) and the tiny model (built here).

Writes benchmarks/results/pd_vllm_pinning.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.testing.procs import cpu_seconds, descendants, free_port  # noqa: E402
from workers.process import cpus_but_first  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TINY = ROOT / ".cache" / "tiny-llama"
BLOCK = 32


def fmt(v: float) -> str:
    return f"{v:.2f}"


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def build_model() -> str:
    from workers.vllm.backend import find_vllm_python

    python = find_vllm_python()
    subprocess.run([python, str(ROOT / "workers" / "vllm" / "testmodel.py"), str(TINY)], check=True, capture_output=True, timeout=600)
    return python


def run_mode(mode: str, n_requests: int, workdir: Path) -> dict:
    rest = cpus_but_first()
    if mode == "pinned" and rest is None:
        raise SystemExit("pinned needs 2+ CPUs")
    pin = ["--engine-cpus", rest] if mode == "pinned" else []
    port, base = free_port(), free_port()
    (workdir / "engine.yaml").write_text('engine_args: ["--dtype", "float32"]\n')
    log = workdir / "up.log"
    argv = [sys.executable, "-m", "orchestrator", "--log-level", "info", "up", "--config", str(workdir / "engine.yaml"), *pin,
            "--backend", "vllm", "--model", str(TINY), "--served-model-name", "tiny", "--prefill-workers", "1", "--decode-workers", "1",
            "--flavor", "vllm", "--port", str(port), "--grpc-port", "0", "--base-port", str(base), "--block-size", str(BLOCK),
            "--max-model-len", "512", "--disagg-mode", "always", "--enforce-disagg"]
    proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    rows: list[dict] = []
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{mode}: the stack did not come up:\n{log.read_text()[-3000:]}")
            try:
                body = httpx.get(url + "/api/cluster", timeout=5).json()
                if sorted(w["role"] for w in body["workers"] if w["state"] == "ready") == ["decode", "prefill"]:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(1)
        time.sleep(5)  # past start-up
        before = httpx.get(url + "/metrics", timeout=30).text
        rng = random.Random(7)
        with httpx.Client(timeout=300) as c:
            for i in range(n_requests):
                prompt = [rng.randrange(5, 300) for _ in range(6 * BLOCK + 7)]
                t0 = time.perf_counter()
                r = c.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                          "ignore_eos": True})
                rows.append({"i": i, "status": r.status_code, "seconds": round(time.perf_counter() - t0, 3)})
                print(f"  {mode} request {i}: {r.status_code} in {rows[-1]['seconds']:.2f} s", flush=True)
        after = httpx.get(url + "/metrics", timeout=30).text
        engine_cpu = sum(cpu_seconds(p) or 0.0 for p in descendants(proc.pid))
        load1 = os.getloadavg()[0]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = log.read_text(errors="replace")
    secs = [r["seconds"] for r in rows]
    lag_sum = _metric(after, "kvyard_event_loop_lag_seconds_sum") - _metric(before, "kvyard_event_loop_lag_seconds_sum")
    return {
        "mode": mode, "engine_cpus": pin[1] if pin else "any", "requests": rows,
        "ok": sum(r["status"] == 200 for r in rows), "failed": sum(r["status"] != 200 for r in rows),
        "seconds_min": min(secs), "seconds_median": statistics.median(secs), "seconds_max": max(secs),
        "loop_stalls": _metric(after, "kvyard_event_loop_stalls_total") - _metric(before, "kvyard_event_loop_stalls_total"),
        "loop_lag_total_s": round(lag_sum, 2),
        "stalls_logged_whole_run": text.count("the event loop stalled"), "lapsed_leases_whole_run": text.count("had lapsed"),
        "engines_cpu_s": round(engine_cpu, 1), "loadavg_1m_end": round(load1, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--modes", nargs="+", default=["loose", "pinned"], choices=["loose", "pinned"])
    ap.add_argument("--out", default="pd_vllm_pinning")
    args = ap.parse_args(argv)
    build_model()
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvyard-pin-") as tmp:
        for mode in args.modes:
            d = Path(tmp) / mode
            d.mkdir()
            print(f"{mode}: starting the stack…", flush=True)
            runs.append(run_mode(mode, args.requests, d))
    out = {"cpus": sorted(os.sched_getaffinity(0)), "requests_per_mode": args.requests, "runs": runs,
           "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(out, indent=2))
    lines = [f"# Real vLLM-CPU P/D over NIXL: engines loose vs pinned ({out['when']}, CPUs {out['cpus']})", "",
             f"{args.requests} greedy requests in a row per mode (199-token prompt, 8 out), `--disagg-mode always --enforce-disagg`.", "",
             "| mode | engine CPUs | ok / failed | request s (min / median / max) | loop stalls | loop lag total s | "
             "stalls logged (whole run) | lapsed leases | engines CPU s | load 1m |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['mode']} | {r['engine_cpus']} | {r['ok']} / {r['failed']} | {fmt(r['seconds_min'])} / "
                     f"{fmt(r['seconds_median'])} / {fmt(r['seconds_max'])} | {r['loop_stalls']:.0f} | {r['loop_lag_total_s']} | "
                     f"{r['stalls_logged_whole_run']} | {r['lapsed_leases_whole_run']} | {r['engines_cpu_s']} | {r['loadavg_1m_end']} |")
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
