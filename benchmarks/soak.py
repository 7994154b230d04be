"""Soak: thousands of concurrent streaming connections for minutes; memory, FDs and TTFT must stay flat.

    python -m benchmarks.soak                          # 2,000 streams for 10 minutes (the recorded run)
    python -m benchmarks.soak --connections 200 --minutes 1 --out /tmp/soak-smoke   # a smoke run

A private Redis, `--workers` sim engines (`kvyard worker`, separate processes) and one `kvyard frontend`
on this machine. The client (aiohttp, uvloop, one session without a connection limit) keeps
`--connections` streaming completions open at all times: each connection sends a streaming request,
reads it to `[DONE]` and sends the next one (closed loop; starts spread over `--ramp` seconds).
The sim is slowed (`--speedup` < 1) so each stream lasts ~`max_tokens` x ITL seconds and the token
rate fits the two shared CPUs: the point is many long-lived connections, not tokens per second.

Every `--sample` seconds: RSS and open FDs of the frontend, each worker (worker process + its engine)
and the client, and the client's open streams. Per minute: TTFT p50/p99, requests completed, errors.
The report fits a line to RSS and FDs over the steady state (after the ramp and the first minute)
and gives the slope per minute; `flat` means |slope| x duration stays within 5% of the level (and FDs
within 1% of the connection count). The verdict covers the system under test (frontend and workers);
the client, the load generator, is listed but left out (it keeps a record of every request it made).
Writes {out}.json, {out}.md and {out}.png; `--from-json {out}.json` redraws the report from a recorded run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import random
import resource
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from benchmarks.histdelta import hist_delta
from orchestrator.testing.procs import KvyardCluster, RedisServer, cpu_seconds, descendants, rss_and_fds

MODEL = "soak"
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class ClientStats:
    open_streams: int = 0
    started: int = 0
    completed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    # (finish wall time, ttft s or None, ok)
    done: list[tuple[float, float | None, bool]] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


def raise_fd_limit(need: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(need, soft)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))  # children (frontend, workers) inherit it
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def stream_once(session: aiohttp.ClientSession, url: str, body: dict, stats: ClientStats, deadline_s: float) -> None:
    t0 = time.monotonic()
    ttft = None
    stats.open_streams += 1
    stats.started += 1
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(url, json=body) as r:
                if r.status != 200:
                    await r.read()
                    stats.error(f"http {r.status}")
                    stats.done.append((time.time(), None, False))
                    await asyncio.sleep(1.0)  # a refused request is retried, not hammered
                    return
                finished = False
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    if line.startswith(b"data: [DONE]"):
                        finished = True
                        break
                    if ttft is None and (b'"text":"' in line or b'"content":"' in line):
                        ttft = time.monotonic() - t0
                    if b'"error"' in line and b'"choices"' not in line:
                        stats.error("stream error")
                        stats.done.append((time.time(), ttft, False))
                        return
                if not finished:
                    stats.error("stream ended without [DONE]")
                    stats.done.append((time.time(), ttft, False))
                    return
        stats.completed += 1
        stats.done.append((time.time(), ttft, True))
    except TimeoutError:
        stats.error("deadline")
        stats.done.append((time.time(), ttft, False))
    except (aiohttp.ClientError, OSError) as exc:
        stats.error(type(exc).__name__)
        stats.done.append((time.time(), ttft, False))
        await asyncio.sleep(1.0)
    finally:
        stats.open_streams -= 1


async def unloaded_ttft(session, url: str, args, n: int = 3) -> float | None:
    """TTFT of a lone request on the idle cluster (the floor the soak's TTFT is compared with)."""
    stats = ClientStats()
    for i in range(n):
        await stream_once(session, url, {"model": MODEL, "prompt": f"baseline {i}: tell me a long story about the sea and the wind",
                                         "max_tokens": 2, "stream": True, "ignore_eos": True}, stats, args.deadline)
    ttfts = [d[1] for d in stats.done if d[1] is not None and d[2]]
    return statistics.median(ttfts) if ttfts else None


async def engine_probe(session, cluster: KvyardCluster, args, probe: ClientStats, stop: asyncio.Event) -> None:
    """Every 2 s a short request straight to one engine (round robin), bypassing the frontend: the engine's own
    TTFT under the same load, so the frontend's share of the soak's TTFT can be told apart from the slowed sim's."""
    names = sorted(cluster.engine_ports)
    i = 0
    while not stop.is_set():
        port = cluster.engine_ports[names[i % len(names)]]
        body = {"model": MODEL, "prompt": f"probe {i}: tell me a long story about the sea and the wind", "max_tokens": 2, "stream": True,
                "ignore_eos": True}
        await stream_once(session, f"http://127.0.0.1:{port}/v1/completions", body, probe, args.deadline)
        i += 1
        await asyncio.sleep(2.0)


async def connection_loop(k: int, session, url: str, args, stats: ClientStats, stop: asyncio.Event) -> None:
    await asyncio.sleep(args.ramp * k / max(args.connections, 1))
    rng = random.Random(k)
    i = 0
    while not stop.is_set():
        # lengths spread over [max_tokens/2, 3 max_tokens/2] so the streams do not end (and restart) in waves
        n = rng.randint(max(1, args.max_tokens // 2), args.max_tokens * 3 // 2)
        body = {"model": MODEL, "prompt": f"conn {k} req {i}: tell me a long story about the sea and the wind", "max_tokens": n,
                "stream": True, "ignore_eos": True}
        await stream_once(session, url, body, stats, args.deadline)
        i += 1


# where the time to first token goes, from the stack's own histograms (frontend, then every engine summed)
_FRONTEND_HISTS = {"admission_wait": "kvyard_admission_wait_seconds", "frontend_ttft": "kvyard_time_to_first_token_seconds",
                   "route_decision": "kvyard_router_decision_seconds"}
_ENGINE_HISTS = {"engine_queue": "vllm:request_queue_time_seconds", "engine_prefill": "vllm:request_prefill_time_seconds",
                 "engine_ttft": "vllm:time_to_first_token_seconds"}


async def scrape(session, cluster: KvyardCluster) -> tuple[str, str]:
    """The frontend's /metrics and all engines' /metrics concatenated ("" where a scrape fails)."""
    async def get(url: str) -> str:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as r:
                return await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return ""
    texts = await asyncio.gather(get(cluster.url("frontend") + "/metrics"),
                                 *(get(f"http://127.0.0.1:{p}/metrics") for p in cluster.engine_ports.values()))
    return texts[0], "\n".join(texts[1:])


def breakdown(before: tuple[str, str], after: tuple[str, str]) -> dict:
    """Histograms over the steady state: what the frontend and the engines each measured."""
    out = {k: hist_delta(before[0], after[0], n) for k, n in _FRONTEND_HISTS.items()}
    out.update({k: hist_delta(before[1], after[1], n) for k, n in _ENGINE_HISTS.items()})
    return out


def _pids(cluster: KvyardCluster) -> dict[str, list[int]]:
    """Each process we watch, with its children (a worker's engine)."""
    out: dict[str, list[int]] = {}
    for name, ch in [*cluster.frontends.items(), *cluster.workers.items()]:
        if ch.pid is None:
            continue
        out[name] = [ch.pid, *descendants(ch.pid)]
    out["client"] = [os.getpid()]
    return out


def sample(cluster: KvyardCluster, t0: float, stats: ClientStats) -> dict:
    row: dict = {"t": round(time.time() - t0, 2), "open_streams": stats.open_streams}
    for name, pids in _pids(cluster).items():
        rss = fds = cpu = 0.0
        for pid in pids:
            got = rss_and_fds(pid)
            if got is not None:
                rss += got[0]
                fds += got[1]
            cpu += cpu_seconds(pid) or 0.0
        row[name] = {"rss_mib": round(rss, 1), "fds": int(fds), "cpu_s": round(cpu, 2)}
    return row


def slope_per_min(ts: list[float], ys: list[float]) -> float:
    if len(ts) < 3:
        return 0.0
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - mt) ** 2 for t in ts)
    return 60.0 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / den if den else 0.0


def pct(vs: list[float], q: float) -> float | None:
    if not vs:
        return None
    vs = sorted(vs)
    return vs[min(len(vs) - 1, int(q * len(vs)))]


def analyse(samples: list[dict], stats: ClientStats, t0: float, args) -> dict:
    steady_from = max(args.ramp, 60.0) if args.minutes >= 3 else args.ramp
    steady = [s for s in samples if s["t"] >= steady_from]
    procs = [k for k in samples[-1] if isinstance(samples[-1][k], dict)] if samples else []
    trend = {}
    for p in procs:
        rows = [s for s in steady if p in s]
        ts = [s["t"] for s in rows]
        for metric in ("rss_mib", "fds"):
            ys = [s[p][metric] for s in rows]
            if not ys:
                continue
            slope = slope_per_min(ts, ys)
            level = statistics.fmean(ys)
            span_min = (ts[-1] - ts[0]) / 60 if len(ts) > 1 else 0.0
            drift = abs(slope) * span_min
            tol = 0.05 * level if metric == "rss_mib" else max(0.01 * args.connections, 0.05 * level, 5)
            trend.setdefault(p, {})[metric] = {"first": ys[0], "last": ys[-1], "min": min(ys), "max": max(ys), "mean": round(level, 1),
                                               "slope_per_min": round(slope, 3), "drift_over_run": round(drift, 2),
                                               "flat": drift <= tol}
    minutes = []
    n_min = int(args.minutes + 0.999)
    for m in range(n_min):
        lo, hi = t0 + 60 * m, t0 + 60 * (m + 1)
        rows = [d for d in stats.done if lo <= d[0] < hi]
        ttfts = [d[1] for d in rows if d[1] is not None and d[2]]
        opened = [s["open_streams"] for s in samples if 60 * m <= s["t"] < 60 * (m + 1)]
        minutes.append({"minute": m + 1, "completed": sum(1 for d in rows if d[2]), "errors": sum(1 for d in rows if not d[2]),
                        "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
                        "open_streams_min": min(opened) if opened else None, "open_streams_mean": round(statistics.fmean(opened), 1) if opened else None})
    steady_min = [m for m in minutes if m["minute"] > (1 if args.minutes >= 3 else 0) and m["ttft_p99_s"] is not None]
    all_ttft = [d[1] for d in stats.done if d[1] is not None and d[2] and d[0] >= t0 + steady_from]
    return {"trend": trend, "minutes": minutes,
            "ttft_steady": {"p50_s": pct(all_ttft, 0.5), "p90_s": pct(all_ttft, 0.9), "p99_s": pct(all_ttft, 0.99), "n": len(all_ttft),
                            "worst_minute_p99_s": max((m["ttft_p99_s"] for m in steady_min), default=None)},
            "steady_from_s": steady_from}


LOAD_GENERATOR = "client"


def system_flat(trend: dict) -> bool:
    """Memory and FDs flat for every process of the system under test (not the load generator)."""
    return all(m.get("flat", False) for p, t in trend.items() if p != LOAD_GENERATOR for m in t.values())


def write_report(out: dict, path: Path) -> None:
    a, c = out["analysis"], out["config"]
    f2 = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    ts = a["ttft_steady"]
    ok = out["verdict"]
    lines = [f"# Soak: {c['connections']} concurrent streams for {c['minutes']} min ({c['workers']} sim workers, 1 frontend)", "",
             f"Command: `{out['command']}`  ", f"Run at {out['started_at']} on {out['machine']}.", "",
             f"- Streams held open: mean {out['open_streams_mean']:.0f}, min {out['open_streams_min']} in the steady state "
             f"(target {c['connections']}).",
             f"- Requests: {out['client']['completed']} completed, {sum(out['client']['errors'].values())} errors "
             f"{out['client']['errors'] or ''}.",
             f"- TTFT of a lone request on the idle cluster: {out['unloaded_ttft_s']:.2f} s (the slowed sim's own prefill + one step).",
             f"- CPU used over the run: " + ", ".join(f"{p} {v:.0f} s" for p, v in out["cpu_s"].items()) + f" ({out['duration_s']:.0f} s wall).",
             f"- TTFT in the steady state: p50 {ts['p50_s']:.2f} s, p90 {ts['p90_s']:.2f} s, p99 {ts['p99_s']:.2f} s; worst minute's p99 "
             f"{ts['worst_minute_p99_s']:.2f} s; target p99 <= {c['ttft_p99_target_s']} s: **{'met' if ok['ttft'] else 'missed'}**.",
             f"- The engines' own TTFT under the same load (a probe straight to one engine every 2 s, bypassing the frontend): "
             f"p50 {f2(a['engine_ttft_steady']['p50_s'])} s, p99 {f2(a['engine_ttft_steady']['p99_s'])} s.",
             f"- Memory and FDs flat (|slope| x steady duration within 5% of the level; FDs within max(1% of the connections, 5)), "
             f"frontend and workers: **{'yes' if ok['flat'] else 'no'}** (the client, the load generator, is listed, not judged).", "",
             "| process | RSS first → last (MiB) | RSS slope (MiB/min) | FDs first → last | FD slope (/min) | flat |", "|---|---|---|---|---|---|"]
    for p, t in a["trend"].items():
        r, f = t.get("rss_mib", {}), t.get("fds", {})
        lines.append(f"| {p} | {r.get('first')} → {r.get('last')} | {r.get('slope_per_min')} | {f.get('first')} → {f.get('last')} | "
                     f"{f.get('slope_per_min')} | {'yes' if r.get('flat') and f.get('flat') else 'no'} |")
    half = out["samples"][-1]["t"] / 2 if out["samples"] else 0.0
    late = [r for r in out["samples"] if r["t"] >= half]
    lines += ["", f"Second half of the run only (t >= {half:.0f} s), the same fit:", "",
              "| process | RSS slope (MiB/min) | FD slope (/min) | FDs max |", "|---|---|---|---|"]
    for p in a["trend"]:
        rows = [r for r in late if p in r]
        ts = [r["t"] for r in rows]
        lines.append(f"| {p} | {slope_per_min(ts, [r[p]['rss_mib'] for r in rows]):.2f} | {slope_per_min(ts, [r[p]['fds'] for r in rows]):.2f} | "
                     f"{max((r[p]['fds'] for r in rows), default=0)} |")
    fe = [m["ttft_p50_s"] - m["engine_ttft_p50_s"] for m in a["minutes"] if m["minute"] > 1 and m.get("engine_ttft_p50_s") is not None
          and m["ttft_p50_s"] is not None]
    if fe:
        lines += ["", f"Frontend's share of TTFT (per-minute p50 via the frontend minus the engine-direct probe's p50, minutes 2..): "
                      f"mean {statistics.fmean(fe):.2f} s, max {max(fe):.2f} s."]
    if out.get("latency_breakdown"):
        lines += ["", "Where the time to first token went over the steady state, from the stack's own histograms (means exact; "
                      "quantiles interpolated inside Prometheus buckets, so coarse):", "",
                  "| histogram | n | mean (s) | p50 | p90 | p99 |", "|---|---:|---:|---:|---:|---:|"]
        for k, h in out["latency_breakdown"].items():
            f4 = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
            lines.append(f"| {k} | {h['n']} | {f4(h['mean'])} | {f4(h['p50'])} | {f4(h['p90'])} | {f4(h['p99'])} |")
    lines += ["", "| minute | completed | errors | TTFT p50 (s) | TTFT p99 (s) | engine-direct TTFT p50 / p99 (s) | open streams (min/mean) |",
              "|---|---|---|---|---|---|---|"]
    f2 = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for m in a["minutes"]:
        lines.append(f"| {m['minute']} | {m['completed']} | {m['errors']} | {f2(m['ttft_p50_s'])} | {f2(m['ttft_p99_s'])} | "
                     f"{f2(m.get('engine_ttft_p50_s'))} / {f2(m.get('engine_ttft_p99_s'))} | {m['open_streams_min']}/{m['open_streams_mean']} |")
    lines += ["", f"Sim: `--speedup {c['speedup']}` (each simulated step {1 / c['speedup']:.0f}x slower than on an H200), "
              f"`max_tokens` uniform in [{c['max_tokens'] // 2}, {c['max_tokens'] * 3 // 2}], `--max-num-seqs` {c['max_num_seqs']} per worker. The steady state starts at "
              f"{a['steady_from_s']:.0f} s (after the ramp and the first minute). The worker rows are the worker process plus its engine. "
              "Plot: soak.png."]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = out["samples"]
    fig, ax = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    ts = [r["t"] / 60 for r in s]
    procs = [k for k in s[-1] if isinstance(s[-1][k], dict)]
    for p in procs:
        ax[0].plot(ts, [r.get(p, {}).get("rss_mib", float("nan")) for r in s], label=p)
        ax[1].plot(ts, [r.get(p, {}).get("fds", float("nan")) for r in s], label=p)
    ax[0].set_ylabel("RSS (MiB)")
    ax[1].set_ylabel("open FDs")
    ax[0].legend(fontsize=8, ncol=3)
    ax[1].plot(ts, [r["open_streams"] for r in s], "k--", label="client: open streams")
    ax[1].legend(fontsize=8, ncol=3)
    mins = out["analysis"]["minutes"]
    mx = [m["minute"] - 0.5 for m in mins]
    ax[2].plot(mx, [m["ttft_p99_s"] for m in mins], "o-", label="TTFT p99")
    ax[2].plot(mx, [m["ttft_p50_s"] for m in mins], "o-", label="TTFT p50")
    ax[2].axhline(out["config"]["ttft_p99_target_s"], color="r", ls=":", label="p99 target")
    ax[2].set_ylabel("TTFT (s), per minute")
    ax[2].set_xlabel("minutes")
    ax[2].legend(fontsize=8)
    fig.suptitle(f"kvyard soak: {out['config']['connections']} concurrent streams, {out['config']['workers']} sim workers")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)


async def amain(args) -> dict:
    limit = raise_fd_limit(4 * args.connections + 1024)
    load_start = os.getloadavg()[0]
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)  # clean up the children
    tmp = Path(tempfile.mkdtemp(prefix="kvyard-soak-"))
    redis = RedisServer(log_dir=tmp)
    redis.start()
    cluster = KvyardCluster(redis.url, tmp, model=MODEL, prefix=f"kvyard-soak-{uuid.uuid4().hex[:6]}", lease_ttl_s=6.0)
    stats = ClientStats()
    probe = ClientStats()
    samples: list[dict] = []
    stop = asyncio.Event()
    baseline = None
    latency = None
    try:
        for i in range(args.workers):
            cluster.add_worker(f"worker{i}", speedup=args.speedup, engine_args=["--max-num-seqs", str(args.max_num_seqs),
                                                                      "--max-num-batched-tokens", str(args.max_num_batched_tokens)])
        cluster.add_frontend("frontend", policy=args.policy)
        await cluster.wait_ready("frontend", args.workers, timeout=180)
        url = cluster.url("frontend") + "/v1/completions"
        print(f"cluster up (fd limit {limit}); {args.connections} connections for {args.minutes} min; logs in {tmp}", flush=True)
        conn = aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=False, keepalive_timeout=30)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as session:
            baseline = await unloaded_ttft(session, url, args)
            print(f"unloaded TTFT {baseline}", flush=True)
            t0 = time.time()
            tasks = [asyncio.create_task(connection_loop(k, session, url, args, stats, stop)) for k in range(args.connections)]
            probe_task = asyncio.create_task(engine_probe(session, cluster, args, probe, stop))
            end = t0 + 60 * args.minutes
            next_print = t0 + 30
            steady_at = t0 + (max(args.ramp, 60.0) if args.minutes >= 3 else args.ramp)  # as analyse() has it
            scraped = None
            while time.time() < end:
                if scraped is None and time.time() >= steady_at:
                    scraped = await scrape(session, cluster)
                samples.append(sample(cluster, t0, stats))
                if time.time() >= next_print:
                    s = samples[-1]
                    print(f"t={s['t']:.0f}s open={s['open_streams']} completed={stats.completed} errors={sum(stats.errors.values())} "
                          f"frontend rss={s.get('frontend', {}).get('rss_mib')} fds={s.get('frontend', {}).get('fds')}", flush=True)
                    next_print += 30
                await asyncio.sleep(args.sample)
            latency = breakdown(scraped, await scrape(session, cluster)) if scraped else None
            stop.set()
            # let the streams in flight finish (closed loop stops issuing); anything left past the deadline is cancelled
            await asyncio.wait([*tasks, probe_task], timeout=args.deadline + 5)
            for t in [*tasks, probe_task]:
                t.cancel()
            await asyncio.gather(*tasks, probe_task, return_exceptions=True)
    finally:
        cluster.stop()
        redis.stop()
    analysis = analyse(samples, stats, t0, args)
    for m in analysis["minutes"]:
        lo, hi = t0 + 60 * (m["minute"] - 1), t0 + 60 * m["minute"]
        pt = [d[1] for d in probe.done if lo <= d[0] < hi and d[1] is not None and d[2]]
        m["engine_ttft_p50_s"], m["engine_ttft_p99_s"] = pct(pt, 0.5), pct(pt, 0.99)
    steady_probe = [d[1] for d in probe.done if d[0] >= t0 + analysis["steady_from_s"] and d[1] is not None and d[2]]
    analysis["engine_ttft_steady"] = {"p50_s": pct(steady_probe, 0.5), "p99_s": pct(steady_probe, 0.99), "n": len(steady_probe)}
    steady = [s["open_streams"] for s in samples if s["t"] >= analysis["steady_from_s"]]
    ts = analysis["ttft_steady"]
    flat = system_flat(analysis["trend"])
    return {"command": "python -m benchmarks.soak " + " ".join(sys.argv[1:]),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
            "machine": f"{os.cpu_count()} CPUs (shared with other work; load average {load_start:.2f} at the start, "
                       f"{os.getloadavg()[0]:.2f} at the end), fd limit {limit}",
            "config": {k: v for k, v in vars(args).items() if k != "out"},
            "unloaded_ttft_s": baseline,
            "duration_s": samples[-1]["t"] if samples else 0.0,
            "cpu_s": {p: round(v["cpu_s"] - samples[0][p]["cpu_s"], 1) for p, v in samples[-1].items()
                      if isinstance(v, dict) and samples and p in samples[0]} if samples else {},
            "client": {"completed": stats.completed, "started": stats.started, "errors": stats.errors},
            "open_streams_mean": statistics.fmean(steady) if steady else 0.0, "open_streams_min": min(steady) if steady else 0,
            "verdict": {"flat": flat, "ttft": ts["p99_s"] is not None and ts["p99_s"] <= args.ttft_p99_target_s,
                        "no_errors": not stats.errors},
            "latency_breakdown": latency, "analysis": analysis, "samples": samples}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=2000)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--speedup", type=float, default=0.02, help="sim speed-up (< 1: slower than an H200; default 0.02)")
    ap.add_argument("--max-tokens", type=int, default=24, help="mean; each request draws uniformly in [max/2, 3 max/2]")
    ap.add_argument("--max-num-seqs", type=int, default=1024, help="per worker, so every stream is decoding, none queued")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="per worker and step (prefill chunking)")
    ap.add_argument("--policy", default="kv")
    ap.add_argument("--ramp", type=float, default=30.0, help="seconds over which the connections open")
    ap.add_argument("--sample", type=float, default=5.0, help="seconds between RSS/FD samples")
    ap.add_argument("--deadline", type=float, default=600.0, help="per-request client deadline (s)")
    ap.add_argument("--ttft-p99-target-s", type=float, default=10.0, help="at the default 50x slowed sim")
    ap.add_argument("--out", default=str(RESULTS / "soak"), help="output path without suffix")
    ap.add_argument("--from-json", help="no run: redraw the report (.md, .png, verdict) from this recorded .json")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    if args.from_json:
        out = json.loads(Path(args.from_json).read_text())
        out["verdict"]["flat"] = system_flat(out["analysis"]["trend"])
        path = Path(args.from_json).with_suffix("")
    else:
        out = runner(amain(args))
        path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(out, indent=1, default=str))
    write_report(out, path)
    plot(out, path)
    print(path.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
