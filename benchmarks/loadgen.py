"""A small closed-loop load generator for OpenAI-compatible streaming endpoints.

`run_load(url, model, concurrency, requests, ...)` keeps `concurrency` streams open until
`requests` have finished and returns per-request TTFT, inter-chunk gaps and token counts
(from the usage chunk). Used by the benchmarks; not a test.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

__all__ = ["RequestResult", "LoadResult", "run_load", "percentiles"]


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class LoadResult:
    results: list[RequestResult]
    wall_s: float

    def summary(self) -> dict:
        ok = [r for r in self.results if r.ok]
        ttft = [r.ttft_s * 1000 for r in ok]
        gaps = [g * 1000 for r in ok for g in r.gaps_s]
        tokens = sum(r.completion_tokens for r in ok)
        return {
            "requests": len(self.results),
            "errors": len(self.results) - len(ok),
            "wall_s": round(self.wall_s, 3),
            "req_per_s": round(len(ok) / self.wall_s, 2),
            "output_tok_per_s": round(tokens / self.wall_s, 1),
            "ttft_ms": percentiles(ttft),
            "itl_ms": percentiles(gaps),
        }


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(values)
    return {"p50": round(float(np.percentile(a, 50)), 3), "p90": round(float(np.percentile(a, 90)), 3),
            "p99": round(float(np.percentile(a, 99)), 3), "mean": round(float(a.mean()), 3)}


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    t0 = time.perf_counter()
    res = RequestResult(ok=False)
    last = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            buf = b""
            async for chunk in resp.aiter_raw():
                now = time.perf_counter()
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    if not ev.startswith(b"data: {"):
                        continue
                    if b'"usage"' in ev and b'"choices":[]' in ev:
                        usage = json.loads(ev[6:])["usage"]
                        res.completion_tokens = usage["completion_tokens"]
                        res.prompt_tokens = usage["prompt_tokens"]
                        continue
                    if last is None:
                        res.ttft_s = now - t0
                    else:
                        res.gaps_s.append(now - last)
                    last = now
        res.ok = last is not None
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_load(base_url: str, model: str, concurrency: int, requests: int, prompt: str, max_tokens: int,
                   chat: bool = False, timeout_s: float = 600.0) -> LoadResult:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})}
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    results: list[RequestResult] = []
    counter = iter(range(requests))

    async def worker(client: httpx.AsyncClient) -> None:
        for _ in counter:
            results.append(await _one(client, base_url + path, body))

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return LoadResult(results, wall)
