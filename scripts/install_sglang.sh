#!/usr/bin/env bash
# Install SGLang's Python package (no engine kernels) into its own venv (.venv-sglang), for the tests that check
# what kvyard builds against SGLang's own classes: `ServerArgs` parses the command line SglangBackend builds, and
# the KV-event decoder reads frames made with SGLang's `KVEventBatch` msgspec structs
# (tests/unit/workers/sglang/test_sglang_engine_classes.py). `make test` calls it.
#
# Idempotent: if .venv-sglang already imports sglang at the pinned version, nothing is done.
# sglang 0.5.23 hard-requires CUDA packages (flashinfer, sglang-kernel, cuda-python, ...), so it is installed
# with --no-deps, beside torch (CPU build) and the small packages its `server_args` and `kv_events` modules
# import (found by importing them until they load). triton is imported unconditionally by sglang.srt.utils
# (about 1 GB installed). Whole venv: about 2.3 GB; install about 1-2 min with a warm pip cache.
#
# torch: `pip install torch==2.13.0` takes a local CPU wheel on these machines (pip is configured with it).
# Elsewhere the CPU build comes from the PyTorch CPU index: set TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (without it, PyPI's torch is the CUDA build, several GB).
#
# Usage: scripts/install_sglang.sh [VENV_DIR]   (default: <repo>/.venv-sglang; PYTHON overrides python3)
set -euo pipefail

SGLANG_VERSION="0.5.23"
TORCH_VERSION="2.13.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-sglang}"
PY="${PYTHON:-python3}"
DEPS=(numpy pybase64 requests "triton==3.9.0" packaging pillow starlette pydantic pyzmq tqdm aiohttp orjson IPython msgspec)

check() {
    "$VENV/bin/python" - "$SGLANG_VERSION" <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
from sglang.srt.server_args import prepare_server_args  # noqa: F401
from sglang.srt.disaggregation.kv_events import KVEventBatch  # noqa: F401
sys.exit(0 if version("sglang") == sys.argv[1] else 1)
PY
}

if [ -x "$VENV/bin/python" ] && check; then
    echo "sglang $SGLANG_VERSION (ServerArgs, KV events) already installed in $VENV"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV"
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if [ -n "${TORCH_INDEX:-}" ]; then
        torch_ok() { "$VENV/bin/python" -m pip install "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX"; }
    else
        torch_ok() { "$VENV/bin/python" -m pip install "torch==$TORCH_VERSION"; }
    fi
    if ! torch_ok; then
        echo "error: cannot install torch==$TORCH_VERSION (CPU build). On a machine without a local torch wheel, run" >&2
        echo "  TORCH_INDEX=https://download.pytorch.org/whl/cpu scripts/install_sglang.sh" >&2
        exit 1
    fi
fi
"$VENV/bin/python" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
"$VENV/bin/python" -m pip install -q "${DEPS[@]}"

check || { echo "error: sglang $SGLANG_VERSION's ServerArgs / KVEventBatch do not import from $VENV" >&2;
           "$VENV/bin/python" -c "from sglang.srt.server_args import prepare_server_args" || true; exit 1; }
echo "sglang $SGLANG_VERSION (ServerArgs, KV events) installed in $VENV"
