"""What SglangBackend builds, checked by SGLang 0.5.23's own code (in .venv-sglang, scripts/install_sglang.sh).

- The command line: parsed by SGLang's `prepare_server_args` (what `python -m sglang.launch_server` runs) into
  the ServerArgs kvyard means: page size = block size, context length, metrics on, the KV-events JSON accepted
  by SGLang's `KVEventsConfig`, the P/D mode and bootstrap port of each role, the CPU device flags. An unknown
  or misspelt flag would make SGLang's parser exit, failing the test.
- KV events: batches built with SGLang's own `KVEventBatch` / `BlockStored` / `BlockRemoved` /
  `AllBlocksCleared` msgspec structs and encoded as its publisher does decode with workers.sglang.kv_events
  (signed int64 hashes normalised to unsigned, medium kept).
The venv is made by `make test`; without it these tests fail with the command to run (never skip).
"""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

import pytest

from orchestrator.disagg.launch import pd_launch
from workers.sglang.backend import SglangBackend
from workers.sglang.kv_events import decode_payload
from router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from workers.types import EngineLaunchConfig, WorkerRole

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PY = ROOT / ".venv-sglang" / "bin" / "python"
PROBE = ROOT / "tests" / "fixtures" / "engines" / "sglang_probe.py"
U64 = (1 << 64) - 1


def probe(mode: str, stdin: str = "") -> dict:
    if not PY.exists():
        pytest.fail(f"{PY} is missing: run scripts/install_sglang.sh (make test does)")
    proc = subprocess.run([str(PY), str(PROBE), mode], input=stdin, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"SGLang refused it:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cfg(**kw) -> EngineLaunchConfig:
    base = dict(model="/models/tiny", served_model_name="tiny", host="127.0.0.1", port=30000, block_size=32, max_model_len=2048,
                max_num_seqs=16, max_num_batched_tokens=4096, kv_events_endpoint="tcp://*:5557",
                kv_replay_endpoint="tcp://*:5558", kv_events_topic="kv", python="/opt/sglang/bin/python")
    return EngineLaunchConfig(**{**base, **kw})


def server_flags(backend: SglangBackend, c: EngineLaunchConfig) -> list[str]:
    argv = backend.launch_spec(c).argv
    assert argv[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    return argv[3:]


def test_aggregated_command_line_parses_with_sglang_server_args() -> None:
    got = probe("args", json.dumps(server_flags(SglangBackend("cuda"), cfg())))
    assert (got["model_path"], got["served_model_name"], got["host"], got["port"]) == ("/models/tiny", "tiny", "127.0.0.1", 30000)
    assert (got["page_size"], got["context_length"], got["max_running_requests"], got["chunked_prefill_size"]) == (32, 2048, 16, 4096)
    assert got["enable_metrics"] is True and got["disaggregation_mode"] == "null"
    kv = got["kv_events_config"]
    assert (kv["publisher"], kv["endpoint"], kv["replay_endpoint"], kv["topic"]) == ("zmq", "tcp://*:5557", "tcp://*:5558", "kv")


def test_cpu_device_flags_parse() -> None:
    got = probe("args", json.dumps(server_flags(SglangBackend("cpu"), cfg())))
    assert (got["device"], got["attention_backend"]) == ("cpu", "torch_native")


@pytest.mark.parametrize("role", [WorkerRole.PREFILL, WorkerRole.DECODE])
def test_pd_role_flags_parse(role: WorkerRole) -> None:
    pd = pd_launch("sglang", "sglang", role, pick_port=lambda: 9123)  # what `kvyard up --backend sglang` adds
    c = cfg(extra_args=pd.extra_args + ["--disaggregation-transfer-backend", "nixl"])  # a user's engine arg, last
    got = probe("args", json.dumps(server_flags(SglangBackend("cuda"), c)))
    assert got["disaggregation_mode"] == role.value and got["disaggregation_transfer_backend"] == "nixl"
    if role == WorkerRole.PREFILL:
        assert got["disaggregation_bootstrap_port"] == 9123 == pd.bootstrap_port


def test_events_built_with_sglang_structs_decode() -> None:
    first, second = (base64.b64decode(p) for p in probe("events")["payloads"])
    a = decode_payload(first, seq=7)
    assert (a.seq, a.ts, a.dp_rank) == (7, 1.5, 0)
    s1, s2 = a.events
    assert isinstance(s1, BlockStored) and s1.block_hashes == [-5 & U64, 2**62] and s1.parent_block_hash is None
    assert (s1.token_ids, s1.block_size, s1.medium) == (list(range(32)), 16, "GPU")
    assert s2.block_hashes == [(-(2**63)) & U64] and s2.parent_block_hash == 2**62
    assert (s2.medium, s2.lora_name) == ("CPU_PINNED", "ad")
    packed = decode_payload(first, seq=7, packed_ids=True)  # as the KV-event reader asks: uint32 buffers, same ids
    for got, want in zip(packed.events, a.events):
        assert isinstance(got.token_ids, memoryview) and list(got.token_ids) == list(want.token_ids)
        assert (got.block_hashes, got.parent_block_hash, got.medium, got.lora_name) == \
            (want.block_hashes, want.parent_block_hash, want.medium, want.lora_name)
    b = decode_payload(second, seq=8)
    assert b.dp_rank is None and isinstance(b.events[0], BlockRemoved) and b.events[0].block_hashes == [-5 & U64]
    assert isinstance(b.events[1], AllBlocksCleared)
