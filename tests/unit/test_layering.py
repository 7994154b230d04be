"""The packages' dependency direction (docs/architecture.md): the router's core imports no other kvyard package
(its I/O edge, router/events.py, reads registry entries); the planner never imports the frontend; workers never
import the frontend or the planner's core. A test, so an import that breaks the layering fails here, not in review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "router", "planner", "workers")


def imported_packages(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
    return out & set(PACKAGES)


def files(package: str, *exclude: str) -> list[Path]:
    return [p for p in sorted((REPO / package).rglob("*.py")) if not any(str(p.relative_to(REPO)).startswith(e) for e in exclude)]


ALLOWED = {
    # package: (what it may import, files exempt because they are an I/O edge that reads another package's contract)
    "router": ({"router"}, ("router/events.py",)),
    "planner": ({"planner", "router", "workers"}, ()),
    "workers": ({"workers", "router", "planner"}, ()),
}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_follow_the_layering(package):
    allowed, exempt = ALLOWED[package]
    bad = {str(p.relative_to(REPO)): sorted(imported_packages(p) - allowed) for p in files(package, *exempt)}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_workers_use_only_the_planners_telemetry_contract():
    """workers may write telemetry (planner/telemetry) but never reach the planner's decision code."""
    for p in files("workers"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "planner":
                assert node.module.startswith("planner.telemetry"), (p, node.module)
