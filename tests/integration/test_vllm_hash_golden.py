"""The committed golden block hashes (tests/fixtures/vllm/hash_extra_keys.json) are what the installed vLLM computes.

Reruns tests/fixtures/vllm/hash_extra_keys.py under the vLLM interpreter (vLLM's own `get_request_block_hasher`,
`generate_block_hash_extra_keys`, `to_event_extra_keys` on LoRA, multimodal and salted prompts) and compares; the
unit tests check kvyard's recomputation against the same file.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.integration.conftest import REPO, vllm_python_or_fail

pytestmark = pytest.mark.vllm

FIXTURE = REPO / "tests" / "fixtures" / "vllm"


def test_golden_values_match_the_installed_vllm():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    proc = subprocess.run([vllm_python_or_fail(), str(FIXTURE / "hash_extra_keys.py")], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = json.loads(proc.stdout)
    committed = json.loads((FIXTURE / "hash_extra_keys.json").read_text())
    assert fresh["cases"] == committed["cases"]
