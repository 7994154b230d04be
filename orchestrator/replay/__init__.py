"""`kvyard replay`: the frontend's routers, the sim's engines and the planner on a virtual clock (docs/replay.md).

    workload.py   Mooncake traces and synthetic loads
    clock.py      the discrete-event clock
    engine.py     one simulated GPU: the sim's EngineCore (workers/sim/core.py) on the clock
    runner.py     Replay: the frontend's request path, the fleet, scaling, KV events, scrapes
    planning.py   the planner in the loop (kvyard's PlannerLoop), static fleets
    results.py    records, ITL histograms, the summary and minutes within SLA
    bound.py      the fleet bound on prefix-cache hits
    report.py     the summary table, JSON and PNG plots
    cli.py        `kvyard replay`
"""

from orchestrator.replay.clock import VirtualClock
from orchestrator.replay.config import EngineSpec, ReplayConfig, TransferSpec
from orchestrator.replay.runner import Replay
from orchestrator.replay.workload import TraceRequest, Workload, WorkloadError, load_mooncake, synthetic

__all__ = ["EngineSpec", "Replay", "ReplayConfig", "TraceRequest", "TransferSpec", "VirtualClock", "Workload", "WorkloadError",
           "load_mooncake", "synthetic"]
