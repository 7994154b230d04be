"""Fault injection under load: workers SIGKILLed and restarted, Redis killed and restarted, frontends killed.

    python -m benchmarks.faults                        # the recorded run (~3 minutes)
    python -m benchmarks.faults --time-scale 0.5 --out /tmp/faults-smoke

The cluster: a private Redis (its own port, no persistence: a restart comes back empty), `--workers`
sim engines (`kvyard worker` processes) and two `kvyard frontend` processes on fixed ports. The
client: `--concurrency` closed loops of streaming completions (max_tokens fixed, usage requested),
spread over both frontends; a connection refused (frontend down) or a 503 is retried on the other
frontend, as a client behind a load balancer would see it. Every request has a client deadline of
`--deadline` seconds, far above its normal latency (about a second), so a hang is counted, not waited for.

Each request ends as exactly one of:
  completed      200, `[DONE]`, usage.completion_tokens == max_tokens (a migrated stream included)
  failed_clean   an OpenAI error: HTTP 4xx/5xx with error JSON, or an error event in the stream
  cut_by_kill    the stream broke while the frontend serving it was being SIGKILLed (the client sees the
                 reset connection; nothing can carry a stream over its frontend's death)
  truncated      acknowledged (200) but ended without `[DONE]` or short of max_tokens, with no error:
                 silent loss, must be 0
  hung           no end within the deadline: must be 0
Migrations and engine retries come from the frontends' /metrics (kvyard_migrations_total by outcome,
kvyard_engine_retries_total), summed over every frontend process. Writes {out}.json and {out}.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.testing.procs import KvyardCluster, RedisServer, free_port

MODEL = "faults"
RESULTS = Path(__file__).resolve().parent / "results"
OUTCOMES = ("completed", "failed_clean", "cut_by_kill", "truncated", "hung")

# (second, action, target): the default schedule, stretched by --time-scale
SCHEDULE = [
    (20, "kill_worker", "worker0"), (30, "start_worker", "worker0"),
    (45, "kill_worker", "worker1"), (55, "start_worker", "worker1"),
    (65, "kill_redis", None), (73, "start_redis", None),
    (85, "kill_frontend", "fe1"), (90, "start_frontend", "fe1"),
    (100, "restart_redis", None), (100, "kill_worker", "worker2"), (110, "start_worker", "worker2"),
    (120, "kill_frontend", "fe2"), (125, "start_frontend", "fe2"),
    (135, "kill_worker", "worker3"), (135, "kill_worker", "worker0"), (145, "start_worker", "worker3"), (145, "start_worker", "worker0"),
]
LOAD_END = 160


@dataclass
class Tally:
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    details: dict[str, int] = field(default_factory=dict)
    client_failovers: int = 0  # connection refused or 503 on one frontend, retried on the other
    records: list[dict] = field(default_factory=list)

    def end(self, outcome: str, detail: str, t0: float, frontend: str) -> None:
        self.outcomes[outcome] += 1
        key = f"{outcome}: {detail}"
        self.details[key] = self.details.get(key, 0) + 1
        self.records.append({"t": round(time.time() - t0, 2), "outcome": outcome, "detail": detail, "frontend": frontend})


class Rig:
    def __init__(self, args, tmp: Path) -> None:
        self.args = args
        self.redis = RedisServer(log_dir=tmp)
        self.cluster = KvyardCluster(self.redis.url, tmp, model=MODEL, prefix=f"kvyard-faults-{uuid.uuid4().hex[:6]}",
                                     lease_ttl_s=args.lease_ttl)
        self.ports = {"fe1": free_port(), "fe2": free_port()}
        self.killing: dict[str, float] = {}  # frontend -> time it was SIGKILLed (streams cut then are expected)
        self.events: list[dict] = []
        self.metrics: dict[tuple[str, int], dict[str, float]] = {}  # (frontend, start#) -> last counters seen

    def start(self) -> None:
        self.redis.start()
        for i in range(self.args.workers):
            self.start_worker(f"worker{i}")
        for fe in self.ports:
            self.start_frontend(fe)

    def start_worker(self, name: str) -> None:
        self.cluster.add_worker(name, speedup=self.args.speedup)

    def start_frontend(self, name: str) -> None:
        ch = self.cluster.frontends.get(name)
        if ch is not None:
            ch.start()  # same port, a new process
        else:
            self.cluster.add_frontend(name, policy="kv", port=self.ports[name])

    def url(self, fe: str) -> str:
        return f"http://127.0.0.1:{self.ports[fe]}"

    def act(self, action: str, target: str | None, t0: float) -> None:
        self.events.append({"t": round(time.time() - t0, 2), "action": action, "target": target})
        print(f"t={time.time() - t0:6.1f}s {action} {target or ''}", flush=True)
        if action == "kill_worker":
            self.cluster.workers[target].kill()
        elif action == "start_worker":
            self.start_worker(target)
        elif action == "kill_redis":
            self.redis.kill()
        elif action == "start_redis":
            self.redis.start()
        elif action == "restart_redis":
            self.redis.restart()
        elif action == "kill_frontend":
            self.killing[target] = time.time()
            self.cluster.frontends[target].kill()
        elif action == "start_frontend":
            self.start_frontend(target)
        else:
            raise ValueError(action)

    async def scrape(self, session: aiohttp.ClientSession) -> None:
        for fe, ch in self.cluster.frontends.items():
            if not ch.alive():
                continue
            try:
                async with session.get(self.url(fe) + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    text = await r.text()
            except (aiohttp.ClientError, OSError, TimeoutError):
                continue
            got: dict[str, float] = {}
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    if s.name == "kvyard_migrations_total":
                        k = f"migrations[{s.labels.get('outcome', '')}]"
                        got[k] = got.get(k, 0.0) + s.value
                    elif s.name in ("kvyard_engine_retries_total", "kvyard_request_deadline_exceeded_total", "kvyard_admission_rejected_total"):
                        got[s.name] = got.get(s.name, 0.0) + s.value
            self.metrics[(fe, ch.starts)] = got

    def counters(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for got in self.metrics.values():
            for k, v in got.items():
                total[k] = total.get(k, 0.0) + v
        return total

    def stop(self) -> None:
        self.cluster.stop()
        self.redis.stop()


async def one_request(session: aiohttp.ClientSession, rig: Rig, first: str, body: dict, tally: Tally, t0: float) -> None:
    args = rig.args
    order = [first, "fe2" if first == "fe1" else "fe1"]
    try:
        async with asyncio.timeout(args.deadline):
            for attempt in range(6):
                fe = order[attempt % 2]
                try:
                    async with session.post(rig.url(fe) + "/v1/completions", json=body) as r:
                        if r.status == 503 and attempt < 5:  # saturated or no workers yet (a restarted frontend): honour Retry-After
                            await r.read()
                            tally.client_failovers += 1
                            await asyncio.sleep(min(float(r.headers.get("retry-after", "0.5") or 0.5), 1.0))
                            continue
                        if r.status != 200:
                            raw = await r.read()
                            try:
                                err = json.loads(raw)["error"]
                                ok = isinstance(err.get("message"), str) and "type" in err
                            except (ValueError, KeyError, TypeError, AttributeError):
                                ok = False
                            tally.end("failed_clean" if ok else "truncated", f"http {r.status}" + ("" if ok else " without error JSON"), t0, fe)
                            return
                        usage, done, error = None, False, None
                        try:
                            async for line in r.content:
                                if not line.startswith(b"data: "):
                                    continue
                                if line.startswith(b"data: [DONE]"):
                                    done = True
                                    break
                                chunk = json.loads(line[6:])
                                if "error" in chunk:
                                    error = chunk["error"]
                                usage = chunk.get("usage") or usage
                        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionResetError) as exc:
                            killed = rig.killing.get(fe)
                            if killed is not None and abs(time.time() - killed) < 3.0:
                                tally.end("cut_by_kill", f"frontend {fe} killed mid-stream", t0, fe)
                            else:
                                tally.end("truncated", f"stream broke: {type(exc).__name__}", t0, fe)
                            return
                        if error is not None:
                            tally.end("failed_clean", f"stream error {error.get('code') or error.get('type')}", t0, fe)
                        elif done and usage and usage.get("completion_tokens") == body["max_tokens"]:
                            tally.end("completed", "ok", t0, fe)
                        else:
                            tally.end("truncated", f"done={done} usage={usage}", t0, fe)
                        return
                except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
                    # refused (frontend down) or dropped before any answer: nothing was acknowledged, try the other one
                    killed = rig.killing.get(fe)
                    if isinstance(exc, aiohttp.ServerDisconnectedError) and not (killed and abs(time.time() - killed) < 3.0):
                        tally.end("truncated", "disconnected before headers", t0, fe)
                        return
                    tally.client_failovers += 1
                    await asyncio.sleep(0.2)
            tally.end("failed_clean", "no frontend answered after 6 tries", t0, order[0])
    except TimeoutError:
        tally.end("hung", f"no end within {args.deadline:.0f} s", t0, first)


async def load_loop(k: int, session, rig: Rig, tally: Tally, stop: asyncio.Event, t0: float) -> None:
    i = 0
    await asyncio.sleep(k * 0.05)
    while not stop.is_set():
        body = {"model": MODEL, "prompt": f"client {k} request {i}: " + "tell me about fault tolerance " * 4,
                "max_tokens": rig.args.max_tokens, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        await one_request(session, rig, "fe1" if k % 2 == 0 else "fe2", body, tally, t0)
        i += 1


async def amain(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvyard-faults-"))
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)  # clean up the children
    rig = Rig(args, tmp)
    tally = Tally()
    stop = asyncio.Event()
    try:
        rig.start()
        for fe in rig.ports:
            await rig.cluster.wait_ready(fe, args.workers, timeout=180)
        print(f"cluster up; logs in {tmp}", flush=True)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)) as session:
            t0 = time.time()
            tasks = [asyncio.create_task(load_loop(k, session, rig, tally, stop, t0)) for k in range(args.concurrency)]
            pending = sorted(((t * args.time_scale, a, tg) for t, a, tg in SCHEDULE), key=lambda x: x[0])
            end = t0 + LOAD_END * args.time_scale
            next_scrape = 0.0
            while time.time() < end:
                now = time.time() - t0
                while pending and pending[0][0] <= now:
                    _, action, target = pending.pop(0)
                    rig.act(action, target, t0)
                if time.time() >= next_scrape:
                    await rig.scrape(session)
                    next_scrape = time.time() + 1.0
                await asyncio.sleep(0.1)
            stop.set()
            await asyncio.wait(tasks, timeout=args.deadline + 10)
            await rig.scrape(session)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.time() - t0
        alive = {n: c.alive() for n, c in [*rig.cluster.workers.items(), *rig.cluster.frontends.items()]}
    finally:
        rig.stop()
    total = sum(tally.outcomes.values())
    counters = rig.counters()
    return {"command": "python -m benchmarks.faults " + " ".join(sys.argv[1:]),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "duration_s": round(duration, 1),
            "machine": f"{os.cpu_count()} CPUs (shared with other work)",
            "config": {k: v for k, v in vars(args).items() if k != "out"},
            "requests": total, "outcomes": tally.outcomes, "details": tally.details, "client_failovers": tally.client_failovers,
            "frontend_counters": counters, "faults": rig.events, "processes_alive_at_end": alive,
            "verdict": {"hung": tally.outcomes["hung"] == 0, "truncated": tally.outcomes["truncated"] == 0},
            "completed_per_second": completed_per_second(tally.records),
            "not_completed": [r for r in tally.records if r["outcome"] != "completed"]}


def completed_per_second(records: list[dict]) -> list[int]:
    """Requests completed in each second of the run: the dips show what each fault cost."""
    out: list[int] = []
    for r in records:
        if r["outcome"] == "completed" and r["t"] >= 0:
            sec = int(r["t"])
            out += [0] * (sec + 1 - len(out))
            out[sec] += 1
    return out


def write_report(out: dict, path: Path) -> None:
    o, c = out["outcomes"], out["frontend_counters"]
    migrated = {k[len("migrations["):-1]: int(v) for k, v in c.items() if k.startswith("migrations[")}
    lines = [f"# Fault injection under load ({out['config']['workers']} sim workers, 2 frontends, private Redis)", "",
             f"Command: `{out['command']}`  ", f"Run at {out['started_at']}, {out['duration_s']:.0f} s, on {out['machine']}; "
             f"{out['config']['concurrency']} concurrent streaming clients, max_tokens {out['config']['max_tokens']}, "
             f"client deadline {out['config']['deadline']:.0f} s.", "",
             "| outcome | requests | share |", "|---|---|---|"]
    for k in OUTCOMES:
        lines.append(f"| {k} | {o[k]} | {100 * o[k] / max(out['requests'], 1):.2f}% |")
    lines += [f"| **total** | {out['requests']} | |", "",
              f"- Migrated mid-stream (frontend counter kvyard_migrations_total, by outcome): {migrated or 'none recorded'}; "
              f"re-sent before streaming (kvyard_engine_retries_total): {int(c.get('kvyard_engine_retries_total', 0))}; "
              f"admission refusals: {int(c.get('kvyard_admission_rejected_total', 0))}; "
              f"deadline exceeded: {int(c.get('kvyard_request_deadline_exceeded_total', 0))}.",
              f"- Client fail-overs to the other frontend (refused connection or 503 + Retry-After): {out['client_failovers']}.",
              f"- Hung: **{o['hung']}**; truncated without an error (silent loss): **{o['truncated']}**.", "",
              "Outcome details:", ""]
    lines += [f"- {k}: {v}" for k, v in sorted(out["details"].items())]
    lines += ["", "Faults injected (seconds from the start of the load):", "", "| t (s) | action | target |", "|---|---|---|"]
    lines += [f"| {e['t']:.1f} | {e['action']} | {e['target'] or ''} |" for e in out["faults"]]
    lines += ["", "`cut_by_kill` are streams whose frontend process was SIGKILLed while they ran: the client sees the connection reset "
              "(not a silent loss; an OpenAI client retries it). Workers' SIGKILLs are absorbed by the frontends "
              "(retry before the first token, migration after it); Redis outages by the last known registry."]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--speedup", type=float, default=1.0, help="sim speed-up: streams last about a second")
    ap.add_argument("--lease-ttl", type=float, default=3.0)
    ap.add_argument("--deadline", type=float, default=60.0, help="client deadline per request (s)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="stretch (>1) or compress (<1) the fault schedule")
    ap.add_argument("--out", default=str(RESULTS / "faults"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = asyncio.run(amain(args))
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(out, indent=1, default=str))
    write_report(out, path)
    print(path.with_suffix(".md").read_text())
    return 0 if out["verdict"]["hung"] and out["verdict"]["truncated"] else 1


if __name__ == "__main__":
    sys.exit(main())
