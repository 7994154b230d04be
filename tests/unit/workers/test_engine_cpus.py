"""Engine CPU pinning: Linux CPU lists parse strictly, and an engine process (with its threads) runs only there."""

from __future__ import annotations

import os
import sys

import pytest

from workers.process import EngineProcess, EngineStartError
from workers.types import EngineLaunchConfig, LaunchSpec, parse_cpu_list


@pytest.mark.parametrize("text,cpus", [("1", {1}), ("0-3", {0, 1, 2, 3}), ("1,3,5-6", {1, 3, 5, 6}), (" 2 , 4 ", {2, 4})])
def test_cpu_lists_parse(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == frozenset(cpus)


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "1,,2", "-1", "1.5"])
def test_bad_cpu_lists_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="bad CPU list"):
        parse_cpu_list(text)


class AffinityBackend:
    """An 'engine' that prints the CPUs it and a thread of it may use, then exits."""

    name = "affinity"
    health_path = "/health"

    def launch_spec(self, cfg: EngineLaunchConfig) -> LaunchSpec:
        code = ("import os, threading; out = []; t = threading.Thread(target=lambda: out.append(sorted(os.sched_getaffinity(0)))); "
                "t.start(); t.join(); print(sorted(os.sched_getaffinity(0)), out[0], flush=True)")
        return LaunchSpec([sys.executable, "-c", code], {})


def _run(tmp_path, cpus: frozenset[int] | None) -> str:
    proc = EngineProcess(AffinityBackend(), EngineLaunchConfig(model="m", served_model_name="m", cpus=cpus), tmp_path / "engine.log")
    proc.start()
    proc._proc.wait(30)
    return (tmp_path / "engine.log").read_text().strip()


def test_the_engine_and_its_threads_run_on_the_given_cpus(tmp_path) -> None:
    mine = sorted(os.sched_getaffinity(0))
    one = mine[-1]
    assert _run(tmp_path, frozenset({one})) == f"[{one}] [{one}]"
    assert _run(tmp_path / "all", None) == f"{mine} {mine}"


def test_cpus_outside_this_host_are_refused(tmp_path) -> None:
    with pytest.raises(EngineStartError, match="none of the engine CPUs"):
        _run(tmp_path, frozenset({4096}))
