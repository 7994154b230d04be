"""How long one huge prompt stalls a frontend: the worst /live latency while it is handled, this tree vs another.

    .venv/bin/python benchmarks/hostile_prompt.py [--baseline /path/to/an/older/checkout] [--repeats 3]

A `kvyard frontend` process (this tree's code, and with --baseline the other tree's, alternately, same machine,
same run) discovers one worker in Redis whose context is 8192 or 131072 tokens (its engine is never reached: both
prompts are refused). While one client sends the prompt, another thread GETs /live every 10 ms and records the
slowest answer: what every other client of that frontend waited at worst.

    8 MB    ~8.3 million characters against a 8192-token context: refused by the character bound, untokenized
    4 MB    ~3.9 million characters against 131072 tokens: under the bound, so tokenized (off the loop), then
            refused with its token count
    none    the control: no request, a second of /live pings (this shared machine's own noise)

Needs Redis on 127.0.0.1:6379. Writes benchmarks/results/hostile_prompt.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.testing.procs import free_port  # noqa: E402
from workers.sim.backend import SIM_TOKENIZER_DIR  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CASES = {"8MB": ("hello world " * 690_000, 8192), "4MB": ("abcdef " * 560_000, 131072), "none": ("", 8192)}


def register(redis_url: str, prefix: str, ctx: int) -> None:
    import redis

    doc = {"worker_id": "w0", "model": "m", "backend": "sim", "url": "http://127.0.0.1:9", "block_size": 16,
           "max_model_len": ctx, "tokenizer": str(SIM_TOKENIZER_DIR)}
    r = redis.Redis.from_url(redis_url)
    r.set(f"{prefix}:worker:w0", json.dumps(doc), px=600_000)
    r.sadd(f"{prefix}:workers", "w0")
    r.close()


def one(code_root: Path, redis_url: str, case: str) -> dict:
    prompt, ctx = CASES[case]
    prefix = f"kvyard-hostile-{uuid.uuid4().hex[:6]}"
    register(redis_url, prefix, ctx)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(code_root)}
    fe = subprocess.Popen([sys.executable, "-m", "orchestrator", "--log-level", "warning", "frontend", "--port", str(port),
                           "--grpc-port", "0", "--redis-url", redis_url, "--discovery-prefix", prefix],
                          cwd=code_root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=120) as c:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if c.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the frontend did not see its worker")
                time.sleep(0.2)
            time.sleep(1.5)  # the tokenizer is loaded off the loop after the worker joins
            done, worst, pings = threading.Event(), [0.0], [0]

            def ping() -> None:
                with httpx.Client(timeout=120) as p:
                    while not done.is_set():
                        t = time.perf_counter()
                        p.get(url + "/live")
                        worst[0] = max(worst[0], time.perf_counter() - t)
                        pings[0] += 1
                        time.sleep(0.01)

            th = threading.Thread(target=ping)
            th.start()
            time.sleep(0.3)
            t0 = time.perf_counter()
            if prompt:
                r = c.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
            else:  # the control: the same wait with no request at all (what this busy machine does by itself)
                time.sleep(1.0)
                r = httpx.Response(200, json={})
            took = time.perf_counter() - t0
            time.sleep(0.2)
            done.set()
            th.join()
        return {"status": r.status_code, "code": (r.json().get("error") or {}).get("code"), "request_s": round(took, 3),
                "worst_live_ms": round(worst[0] * 1000, 1), "pings": pings[0]}
    finally:
        fe.terminate()
        fe.wait(10)
        import redis

        rc = redis.Redis.from_url(redis_url)
        rc.delete(f"{prefix}:worker:w0", f"{prefix}:workers", f"{prefix}:epoch")
        rc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to compare with (e.g. the previous main)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = ap.parse_args()
    trees = {"this tree": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    runs: dict[str, dict[str, list[dict]]] = {t: {c: [] for c in CASES} for t in trees}
    for i in range(args.repeats):
        for case in CASES:
            for tree, root in (trees.items() if i % 2 == 0 else reversed(trees.items())):  # alternate the order
                res = one(root, args.redis_url, case)
                runs[tree][case].append(res)
                print(f"round {i + 1} {case} {tree}: {res}", flush=True)
    summary = {t: {c: {"worst_live_ms_median": sorted(r["worst_live_ms"] for r in rs)[len(rs) // 2],
                       "worst_live_ms_max": max(r["worst_live_ms"] for r in rs),
                       "request_s_median": sorted(r["request_s"] for r in rs)[len(rs) // 2]}
                   for c, rs in cases.items()} for t, cases in runs.items()}
    out = {"benchmark": "hostile_prompt", "command": "benchmarks/hostile_prompt.py " + " ".join(sys.argv[1:]),
           "machine": f"{os.cpu_count()} CPUs (shared with other work)", "trees": {t: str(p) for t, p in trees.items()},
           "runs": runs, "summary": summary}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hostile_prompt.json").write_text(json.dumps(out, indent=1))
    lines = ["# One huge prompt vs. everyone else on the frontend", "",
             f"`{out['command']}` on {out['machine']}, {args.repeats} rounds, trees alternated. The slowest /live answer "
             "(ms) while one client's prompt was handled (median of rounds, max in brackets), and how long that request took.", "",
             "| prompt | " + " | ".join(trees) + " |", "|---|" + "---|" * len(trees)]
    for case in CASES:
        cells = [f"{summary[t][case]['worst_live_ms_median']} ms ({summary[t][case]['worst_live_ms_max']}); request "
                 f"{summary[t][case]['request_s_median']} s" for t in trees]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    (RESULTS / "hostile_prompt.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
