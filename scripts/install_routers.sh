#!/usr/bin/env bash
# Install the peer routers and the load generator that benchmarks/routers_compare.py drives, each into its own
# venv (nothing of them is committed, none touches the project's .venv):
#   .venv-vllm-router    vllm-router 0.1.17          (PyPI `vllm-router`; Rust binary behind a Python launcher)
#   .venv-sglang-router  sglang-router 0.3.2         (PyPI `sglang-router`, the SGLang model gateway)
#   .venv-aiperf         aiperf 0.13.0               (the load generator; tokenizes offline, see routers_compare.py)
#
# Idempotent: a venv whose package already imports at the pinned version is left alone.
# Usage: scripts/install_routers.sh [ROOT_FOR_VENVS]   (default: the repo root; PYTHON overrides python3)
set -euo pipefail

VLLM_ROUTER_VERSION="0.1.17"
SGLANG_ROUTER_VERSION="0.3.2"
AIPERF_VERSION="0.13.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT}"
PY="${PYTHON:-python3}"

# install VENV DIST VERSION [EXTRA PIP ARGS...]
install() {
    local venv="$DEST/$1" dist="$2" want="$3"; shift 3
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c \
        "import sys; from importlib.metadata import version; sys.exit(0 if version('$dist') == '$want' else 1)" 2>/dev/null; then
        echo "$dist $want already installed in $venv"
        return 0
    fi
    [ -x "$venv/bin/python" ] || { echo "creating $venv"; "$PY" -m venv "$venv"; }
    "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
    "$venv/bin/python" -m pip install -q "$dist==$want" "$@"
    "$venv/bin/python" -c "from importlib.metadata import version; assert version('$dist') == '$want'" \
        || { echo "error: $dist $want did not install into $venv" >&2; exit 1; }
    echo "$dist $want installed in $venv"
}

install .venv-vllm-router vllm-router "$VLLM_ROUTER_VERSION"
install .venv-sglang-router sglang-router "$SGLANG_ROUTER_VERSION"
install .venv-aiperf aiperf "$AIPERF_VERSION"
