"""Test doubles and process harnesses shared by kvyard's tests and benchmarks (and usable in a user's own tests).

    fake_engine     FakeEngine: a scriptable vLLM-shaped engine (JSON, SSE, faults on demand); winfo; free_port
    fault_engine    FaultEngine: an engine that dies, stalls or breaks streams mid-answer, on a script
    fake_pd_engine  FakePDEngine: the three engines' P/D hand-off protocols, with a book of what each side saw
    sim_thread      ThreadedSim: the sim engine on a free port in a thread (a real engine for in-process tests)
    otlp_receiver   OtlpReceiver: an OTLP/gRPC trace collector on 127.0.0.1 (what a frontend and vLLM export)
    procs           real processes: a private Redis, `kvyard worker` / `kvyard frontend` children, a cluster of them

Not simulators: the simulated engine is workers/sim.
"""

from orchestrator.testing.fake_engine import FakeEngine, ThreadedEngine, free_port, free_port_pair, free_port_run, winfo
from orchestrator.testing.fake_pd_engine import FakePDEngine, HandoffBook
from orchestrator.testing.fault_engine import TOKEN_BASE, WORDS, FaultEngine

__all__ = ["FakeEngine", "FakePDEngine", "FaultEngine", "HandoffBook", "TOKEN_BASE", "ThreadedEngine", "WORDS", "free_port", "free_port_run",
           "free_port_pair", "winfo"]
