"""`python -m benchmarks NAME [flags]`: run one benchmark from a checkout (the benchmarks are not part of the
installed package). NAME is routing, planner or disagg; `python -m benchmarks NAME --help` lists its flags.
Every other benchmark runs as `python -m benchmarks.<module>` (docs/benchmarks.md)."""

from __future__ import annotations

import sys

_MAIN = {"routing": "benchmarks.routing", "planner": "benchmarks.planner_sim", "disagg": "benchmarks.disagg"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in _MAIN:
        print(__doc__, file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(_MAIN[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
