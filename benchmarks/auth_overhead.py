"""What the frontend's doors cost per request: key verification, rate-limit charging (in-process and in
Redis), token estimation, log redaction, and a whole in-process request with and without a key.

    .venv/bin/python benchmarks/auth_overhead.py [--redis-url redis://127.0.0.1:6379/0] [--out benchmarks/results/auth_overhead.json]

Micro-timings are the median of 5 runs of N calls each (time.perf_counter); the end-to-end figure is
the median latency of 300 sequential non-streaming completions through the app (httpx ASGITransport)
against an in-process fake engine, keys off vs keys on (rpm + tpm limits, so every path runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.security import (  # noqa: E402
    KeyFile,
    KeyStore,
    Principal,
    RateLimiter,
    RedisRateLimiter,
    estimate_tokens,
    generate_key,
    redact,
    save_key_file,
)


def per_call_us(fn, n: int) -> float:
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return round(statistics.median(runs), 3)


async def per_call_us_async(fn, n: int) -> float:
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            await fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return round(statistics.median(runs), 3)


async def end_to_end(keyed: bool, n: int = 300) -> float:
    import httpx

    from orchestrator.app import create_app
    from orchestrator.config import FrontendConfig
    from orchestrator.testing import FakeEngine
    from orchestrator.testing import winfo
    from workers.discovery import InMemoryDiscovery

    tmp = Path(tempfile.mkdtemp())
    key, rec = generate_key("bench", rpm=10**9, tpm=10**12)
    save_key_file(tmp / "keys.yaml", KeyFile(keys=[rec]))
    cfg = FrontendConfig(refresh_interval_s=60, grpc_port=0, telemetry={"enabled": False}, security={"api_keys_file": (tmp / "keys.yaml") if keyed else None})
    disc = InMemoryDiscovery()
    with FakeEngine(tokens=4) as eng:
        await disc.register(winfo("a", eng.url), ttl_s=600)
        app = create_app(cfg, disc)
        async with app.router.lifespan_context(app):
            await app.state.pool.refresh()
            headers = {"authorization": f"Bearer {key}"} if keyed else {}
            body = {"model": "m", "prompt": "hello world, a short prompt", "max_tokens": 4}
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvyard") as c:
                lat = []
                for i in range(n + 20):
                    t0 = time.perf_counter()
                    r = await c.post("/v1/completions", json=body, headers=headers)
                    if i >= 20:  # warm-up excluded
                        lat.append(time.perf_counter() - t0)
                    assert r.status_code == 200, r.text
    return round(statistics.median(lat) * 1e3, 3)


async def main_async(args) -> dict:
    logging.disable(logging.WARNING)
    key, rec = generate_key("bench", rpm=60, tpm=100_000)
    store = KeyStore.from_records([rec] + [generate_key(f"k{i}")[1] for i in range(999)])  # 1,000 keys
    wrong = key[:-4] + "AAAA"
    lim = RateLimiter()
    p = Principal("0123456789ab", "b", rpm=10**9, tpm=10**12)
    body = json.dumps({"model": "m", "prompt": "x" * 2000, "max_tokens": 256}).encode()
    out = {
        "verify_valid_key_us": per_call_us(lambda: store.verify(key), 20000),
        "verify_wrong_secret_us": per_call_us(lambda: store.verify(wrong), 20000),
        "verify_unknown_id_us": per_call_us(lambda: store.verify("kvy_ffffffffffff_" + "A" * 43), 20000),
        "local_rate_limit_admit_us": per_call_us(lambda: lim.admit(p, 10), 20000),
        "estimate_tokens_2kB_body_us": per_call_us(lambda: estimate_tokens(body, "completions"), 20000),
        "redact_log_line_us": per_call_us(lambda: redact("worker sim-0 joined at http://127.0.0.1:8100 (4 ready)"), 20000),
    }
    if args.redis_url:
        import redis.asyncio as aioredis

        rl = RedisRateLimiter(args.redis_url, "kvyard-bench-auth")
        plain = aioredis.from_url(args.redis_url)
        try:
            out["redis_ping_us"] = await per_call_us_async(plain.ping, 2000)  # the round trip, for scale
            out["redis_rate_limit_admit_us"] = await per_call_us_async(lambda: rl.admit(p, 10), 2000)
            await plain.delete(f"kvyard-bench-auth:ratelimit:{p.key_id}")
        finally:
            await rl.close()
            await plain.aclose()
    out["e2e_completion_p50_ms_keys_off"] = await end_to_end(False)
    out["e2e_completion_p50_ms_keys_on"] = await end_to_end(True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="'' to skip the Redis limiter")
    ap.add_argument("--out", default="benchmarks/results/auth_overhead.json")
    args = ap.parse_args(argv)
    res = asyncio.run(main_async(args))
    res["note"] = "medians on a shared 2-core CPU machine; e2e = in-process app + fake engine, non-streaming, sequential"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
