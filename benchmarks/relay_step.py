"""The relay step alone: CPU per streamed token from an engine's chunk to the client's write, in one process.

    PYTHONPATH=. .venv/bin/python benchmarks/relay_step.py [--rounds 5] [--streams 400]

What the frontend runs for every token of every stream (orchestrator/service.py `_relay_direct`): the SSE step
(orchestrator/streaming.py), the migration tracker's feed (orchestrator/resilience/migration.py), the inter-token
gap's histogram count, the HTTP chunk framing of the direct write (orchestrator/direct_body.py, to a transport whose
write only takes the bytes). No sockets, no event loop: the system calls and the engine client's parse that surround
this step in the frontend are not in the figure. Five modes, alternated within each round (order rotated):
  python-eager  the Python SseRelay, every event decoded by the tracker as it arrives (how the relay ran before
                orchestrator/_relaycore.c and the lazy tracker)
  python-lazy   the Python SseRelay, the tracker decoding only when read or past PENDING_BYTES of raw events
  c-eager       the C relay, the eager tracker
  c-lazy        the C relay, the lazy tracker keeping its events in Python, a Python callback feeding the relay and
                writing through DirectBody.write (how the frontend ran before the C pipe)
  c-pipe        what the frontend runs now: `relay.pipe(writer, chunk)`, with the C ChunkWriter and the tracker's C
                EventBuffer: no Python frame per token in this step
Workloads: chat chunks as vLLM streams them with the token ids the frontend asks for (stripped before the client),
and as SGLang streams them (no ids, nothing to strip); streams of 95 tokens (the Mooncake trace's mean output in
routers_compare.py) and 512 (its streaming workload), one engine chunk per token.
Reported: median CPU-us per token over the rounds (time.process_time around the whole batch of streams), c-lazy
against python-eager, and c-pipe against c-lazy (the JSON also has c-pipe / c-lazy per round). Writes benchmarks/results/relay_step.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client import CollectorRegistry, Histogram  # noqa: E402

from benchmarks.common import result_header  # noqa: E402
from orchestrator.direct_body import DirectBody  # noqa: E402
from orchestrator.metrics import BatchedObserver  # noqa: E402
from orchestrator.resilience.migration import EventBuffer, StreamTracker, _EventBuffer  # noqa: E402
from orchestrator.streaming import RELAY_IN_C, Relay, SseRelay, StreamStats  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODES = ("python-eager", "python-lazy", "c-eager", "c-lazy", "c-pipe")


def _stream(flavor: str, n: int) -> list[bytes]:
    """One stream's engine chunks: a role chunk, n-1 content chunks, a finish chunk, usage, [DONE]."""
    head = '{"id":"chatcmpl-5b0e2f7c9a8d4e1f","object":"chat.completion.chunk","created":1765000000,"model":"kvyard-sim",'
    ids = flavor == "vllm"
    out = [f'data: {head}"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},"logprobs":null,'
           f'"finish_reason":null}}]}}\n\n']
    for i in range(n):
        last = i == n - 1
        tok = f',"token_ids":[{1000 + i % 50000}]' if ids else ""
        fin = '"length"' if last else "null"
        out.append(f'data: {head}"choices":[{{"index":0,"delta":{{"content":" w{i % 997}"}},"logprobs":null,'
                   f'"finish_reason":{fin}{tok}}}]}}\n\n')
    out.append(f'data: {head}"choices":[],"usage":{{"prompt_tokens":64,"total_tokens":{64 + n},"completion_tokens":{n}}}}}\n\n')
    out.append("data: [DONE]\n\n")
    return [c.encode() for c in out]


class _Transport:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def write(self, data: bytes) -> None:
        self.n += len(data)

    def is_closing(self) -> bool:
        return False


class _Cycle:
    disconnected = False


class _EagerTracker(StreamTracker):
    """The tracker as it ran before: every event decoded as it arrives."""

    def __init__(self) -> None:
        super().__init__(_EventBuffer)
        keep = self.feed

        def feed(ev: bytes) -> None:
            keep(ev)
            self._absorb()
        self.feed = feed


def _run(mode: str, streams: list[list[bytes]], strip: bool, hist) -> float:
    relay_cls = SseRelay if mode.startswith("python") else Relay
    transport = _Transport()
    t = time.process_time()
    for chunks in streams:
        itl = BatchedObserver(hist)
        tracker = _EagerTracker() if mode.endswith("eager") else StreamTracker(EventBuffer if mode == "c-pipe" else _EventBuffer)
        if mode.startswith("python"):  # as the service ran it before: the observer batches, one call per gap
            relay = relay_cls(StreamStats(), False, lambda: None, itl.observe, on_content=tracker.feed, strip_ids=strip)
        else:
            relay = relay_cls(StreamStats(), False, lambda: None, itl.observe, on_content=tracker.feed, strip_ids=strip,
                              gap_bounds=itl.bounds, on_gaps=itl.add)
        direct = DirectBody(_Cycle(), transport)
        if mode == "c-pipe":  # orchestrator/service.py `_relay_direct`
            pipe = functools.partial(relay.pipe, direct.writer())
            for c in chunks:
                pipe(c)
        else:
            feed, write = relay.feed, direct.write

            def on_data(chunk: bytes) -> None:  # the read callback's step before the pipe
                out = feed(chunk)
                if out:
                    write(out)
            for c in chunks:
                on_data(c)
        relay.flush()
        itl.flush()
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=400, help="streams per mode, workload and round")
    ap.add_argument("--out", default="relay_step")
    a = ap.parse_args()
    if not RELAY_IN_C:
        sys.exit("orchestrator._relaycore is not built (pip install -e . builds it); nothing to compare")
    hist = Histogram("itl", "gaps", registry=CollectorRegistry(), buckets=[0.001 * 2 ** i for i in range(16)])
    result = result_header("relay_step") | {"command": "benchmarks/relay_step.py " + " ".join(sys.argv[1:]),
                                            "rounds": a.rounds, "streams": a.streams, "workloads": {}}
    md = ["# The relay step alone: CPU-us per streamed token", "", f"`{result['command']}`; {result['when']}, "
          f"{result['machine']}, load {result['loadavg']['start']}. In one process, no sockets (benchmarks/relay_step.py).",
          "", "| workload | " + " | ".join(MODES) + " | c-lazy / python-eager | c-pipe / c-lazy |",
          "|---" * (len(MODES) + 3) + "|"]
    for flavor in ("vllm", "sglang"):
        for n in (95, 512):
            name = f"{flavor}-{n}"
            streams = [_stream(flavor, n)] * a.streams
            tokens = a.streams * n
            per: dict[str, list[float]] = {m: [] for m in MODES}
            for r in range(a.rounds):
                order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
                for m in order:
                    per[m].append(_run(m, streams, flavor == "vllm", hist) / tokens * 1e6)
            med = {m: statistics.median(v) for m, v in per.items()}
            result["workloads"][name] = {"us_per_token": {m: [round(x, 3) for x in v] for m, v in per.items()},
                                         "median_us_per_token": {m: round(v, 3) for m, v in med.items()},
                                         "vs_python_eager": {m: round(v / med["python-eager"], 3) for m, v in med.items()},
                                         "pipe_vs_c_lazy": [round(p / q, 3) for p, q in zip(per["c-pipe"], per["c-lazy"])]}
            md.append(f"| {name} | " + " | ".join(f"{med[m]:.2f}" for m in MODES)
                      + f" | {med['c-lazy'] / med['python-eager']:.2f} | {med['c-pipe'] / med['c-lazy']:.2f} |")
            print(md[-1], flush=True)
    result["loadavg"]["end"] = round(__import__("os").getloadavg()[0], 2)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.out}.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / f"{a.out}.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
