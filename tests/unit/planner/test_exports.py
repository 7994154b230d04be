"""Every planner / telemetry module declares __all__, and every name in it exists."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import planner
import planner.connectors
import planner.telemetry

MODULES = sorted(
    {m.name for pkg in (planner, planner.connectors, planner.telemetry) for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + ".")}
    | {"planner", "planner.connectors", "planner.telemetry", "orchestrator.routes.admin", "orchestrator.telemetry_recorder",
       "orchestrator.planner_cmd", "orchestrator.local_scaling"}
)


@pytest.mark.parametrize("name", MODULES)
def test_all_is_declared_and_exported(name):
    mod = importlib.import_module(name)
    assert isinstance(getattr(mod, "__all__", None), list), f"{name} has no __all__ list"
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{name}.__all__ names missing attributes: {missing}"
