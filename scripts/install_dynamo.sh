#!/usr/bin/env bash
# Install NVIDIA Dynamo 1.6.1 (CPU: frontend + mocker, no etcd/NATS) into its own venv (.venv-dynamo) for
# benchmarks/dynamo_compare.py. Not part of `make test`; nothing of Dynamo is committed.
#
# Why not `pip install ai-dynamo`: 1.6.1 pins aisimulate==0.13.0, whose PyPI release is a wheel stub that
# downloads from NVIDIA's own index (URLError here). So: the runtime (Rust core, abi3 wheel) with the
# dependencies the frontend and mocker import, then ai-dynamo itself with --no-deps, plus scikit-learn for
# the mocker's profile converter, and what Dynamo's planner imports for its load predictors and reports
# (benchmarks/planner_sim.py runs it in Dynamo's replay).
#
# Idempotent: if .venv-dynamo already imports dynamo.frontend and dynamo.mocker at 1.6.1, nothing is done.
# Usage: scripts/install_dynamo.sh [VENV_DIR]   (default: <repo>/.venv-dynamo; PYTHON overrides python3)
set -euo pipefail

DYNAMO_VERSION="1.6.1"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-dynamo}"
PY="${PYTHON:-python3}"

check() {
    "$VENV/bin/python" - "$DYNAMO_VERSION" <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
import dynamo.frontend, dynamo.mocker, sklearn  # noqa: F401
import filterpy, pandas, plotly, pmdarima, prometheus_api_client, prophet  # noqa: F401  (Dynamo's planner)
sys.exit(0 if version("ai-dynamo") == sys.argv[1] == version("ai-dynamo-runtime") else 1)
PY
}

if [ -x "$VENV/bin/python" ] && check; then
    echo "ai-dynamo $DYNAMO_VERSION already installed in $VENV"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV"
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q "ai-dynamo-runtime==$DYNAMO_VERSION" 'aiohttp>=3.14.3,<4' 'certifi>=2026.10.19' \
    'kubernetes>=32.0.1,<33' 'msgspec>=0.19' 'prometheus-client>=0.23.1,<1' 'pyzmq>=26' 'redis>=6.2,<9' tqdm \
    'transformers>=4.56' typing-extensions 'zstandard>=0.23,<1' scikit-learn \
    'plotly==7.1.0' 'prometheus-api-client==0.7.2' 'pandas==3.1.1' 'pmdarima==2.1.1' 'filterpy==2.0.0' 'prophet==1.5.0'
"$VENV/bin/python" -m pip install -q --no-deps "ai-dynamo==$DYNAMO_VERSION"

check || { echo "error: dynamo $DYNAMO_VERSION does not import from $VENV" >&2; exit 1; }
echo "ai-dynamo $DYNAMO_VERSION installed in $VENV"
