"""VllmBackend.launch_spec: argv, CPU environment, validation, interpreter discovery."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from workers.backend import Backend
from workers.registry import get_backend
from workers.types import EngineLaunchConfig
from workers.vllm.backend import VllmBackend, VllmLaunchError, VllmNotInstalledError, find_vllm_python


def cfg(**kw) -> EngineLaunchConfig:
    base = dict(model="/m/tiny", served_model_name="tiny", port=8123, block_size=32, max_model_len=512, python="/py")
    return EngineLaunchConfig(**{**base, **kw})


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_registered_and_protocol():
    b = get_backend("vllm")
    assert isinstance(b, VllmBackend) and isinstance(b, Backend)
    assert b.name == "vllm" and b.health_path == "/health"


def test_argv_and_cpu_env():
    spec = VllmBackend().launch_spec(cfg(max_num_seqs=8, max_num_batched_tokens=1024))
    argv = spec.argv
    assert argv[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    expected = {"--model": "/m/tiny", "--served-model-name": "tiny", "--host": "127.0.0.1", "--port": "8123",
                "--max-model-len": "512", "--block-size": "32", "--max-num-seqs": "8",
                "--max-num-batched-tokens": "1024", "--dtype": "bfloat16"}  # fmt: skip
    assert {k: flag(argv, k) for k in expected} == expected
    assert "--enforce-eager" in argv and "--kv-events-config" not in argv
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == "1" and spec.env["VLLM_TARGET_DEVICE"] == "cpu"
    assert spec.env["HF_HUB_OFFLINE"] == "1" and spec.env["VLLM_HOST_IP"] == "127.0.0.1"
    assert "PYTHONHASHSEED" not in spec.env  # it would change vLLM's block-hash seed
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"  # co-located engines must not share pinned cores


def test_kv_events_config_json():
    spec = VllmBackend().launch_spec(
        cfg(kv_events_endpoint="ipc:///t/ev.sock", kv_replay_endpoint="ipc:///t/rp.sock", kv_events_topic="kv")
    )
    assert json.loads(flag(spec.argv, "--kv-events-config")) == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///t/ev.sock",
        "replay_endpoint": "ipc:///t/rp.sock", "topic": "kv",
    }  # fmt: skip
    no_replay = VllmBackend().launch_spec(cfg(kv_events_endpoint="tcp://*:5557"))
    assert "replay_endpoint" not in json.loads(flag(no_replay.argv, "--kv-events-config"))


def test_extra_args_last_and_env_overrides():
    spec = VllmBackend().launch_spec(cfg(extra_args=["--dtype", "float32"], env={"VLLM_CPU_KVCACHE_SPACE": "4", "X": "1"}))
    assert spec.argv[-2:] == ["--dtype", "float32"]
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == "4" and spec.env["X"] == "1"


@pytest.mark.parametrize("host,ip", [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("10.1.2.3", "10.1.2.3"), ("localhost", "127.0.0.1")])
def test_host_ip(host, ip):
    assert VllmBackend().launch_spec(cfg(host=host)).env["VLLM_HOST_IP"] == ip


@pytest.mark.parametrize("bad", [dict(block_size=16), dict(block_size=0), dict(max_model_len=0), dict(kv_replay_endpoint="ipc:///r")])
def test_validation(bad):
    with pytest.raises(VllmLaunchError):
        VllmBackend().launch_spec(cfg(**bad))


def test_cuda_device_allows_block_16_and_no_cpu_flags():
    spec = VllmBackend(device="cuda").launch_spec(cfg(block_size=16))
    assert "--enforce-eager" not in spec.argv and "VLLM_TARGET_DEVICE" not in spec.env
    with pytest.raises(VllmLaunchError):
        VllmBackend(device="tpu")


def test_python_discovery(tmp_path: Path):
    py = tmp_path / ".venv-vllm" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.touch()
    assert find_vllm_python([tmp_path / "nope", tmp_path]) == str(py)
    with pytest.raises(VllmNotInstalledError, match="install_vllm.sh"):
        find_vllm_python([tmp_path / "nope"])


def test_testmodel_is_standalone():
    """testmodel.py runs under the engine's interpreter, which has no kvyard."""
    src = Path(__file__).resolve().parents[4] / "workers" / "vllm" / "testmodel.py"
    tree = ast.parse(src.read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not mods & {"workers", "router", "orchestrator", "planner"}
