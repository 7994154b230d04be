"""TrtllmBackend: the trtllm-serve command line, the LLM API options YAML, the metrics parsers, the KV-event relay.

What the backend writes is checked against TensorRT-LLM's own option and field names. Where `tensorrt_llm`
imports (a GPU machine with it installed) they come from the package itself (`serve` click options,
`TorchLlmArgs` / `KvCacheConfig` / `CacheTransceiverConfig` model fields); here it cannot be installed (PyPI
has only a stub that pulls from NVIDIA's index), so they come from tests/fixtures/trtllm/surface.json,
recorded from TensorRT-LLM's source (which file and commit: in that file). `SURFACE_SOURCE` says which was used.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import yaml

from router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from workers.registry import get_backend
from workers.trtllm.backend import TrtllmBackend, TrtllmLaunchError, llm_api_options, merge_options
from workers.trtllm.kv_events import encode_events
from workers.trtllm.metrics import parse_trtllm_metrics
from workers.trtllm.relay import KvEventRelay, KvRelayError, RelaySettings
from workers.types import EngineLaunchConfig
from workers.vllm.kv_events import decode_payload

FIXTURE = Path(__file__).resolve().parents[3] / "fixtures" / "trtllm" / "surface.json"


def _surface() -> tuple[str, dict]:
    try:  # pragma: no cover - only where TensorRT-LLM is installed
        from tensorrt_llm.commands.serve import serve
        from tensorrt_llm.llmapi.llm_args import CacheTransceiverConfig, KvCacheConfig, TorchLlmArgs
    except ImportError:
        data = json.loads(FIXTURE.read_text())
        return "recorded from TensorRT-LLM source (tests/fixtures/trtllm/surface.json)", data
    opts = [o for p in serve.params for o in p.opts if o.startswith("--")]
    return "the installed tensorrt_llm package", {"trtllm_serve_options": opts, "llm_args": {
        "top_level": list(TorchLlmArgs.model_fields), "kv_cache_config": list(KvCacheConfig.model_fields),
        "cache_transceiver_config": list(CacheTransceiverConfig.model_fields),
        "cache_transceiver_backends": ["DEFAULT", "UCX", "NIXL", "MPI"]}}


SURFACE_SOURCE, SURFACE = _surface()


def cfg(**kw) -> EngineLaunchConfig:
    base = dict(model="/models/llama", served_model_name="llama", host="127.0.0.1", port=8300, block_size=32, max_model_len=4096,
                max_num_seqs=64, max_num_batched_tokens=8192, kv_events_endpoint="tcp://*:9300", python="/opt/trt/bin/python")
    return EngineLaunchConfig(**{**base, **kw})


def check_options(options: dict) -> None:
    la = SURFACE["llm_args"]
    assert set(options) <= set(la["top_level"]), f"not LLM API options ({SURFACE_SOURCE}): {set(options) - set(la['top_level'])}"
    assert set(options.get("kv_cache_config", {})) <= set(la["kv_cache_config"])
    ctc = options.get("cache_transceiver_config", {})
    assert set(ctc) <= set(la["cache_transceiver_config"])
    assert ctc.get("backend", "DEFAULT") in la["cache_transceiver_backends"]


@pytest.mark.parametrize("role", ["both", "prefill", "decode"])
def test_command_line_and_yaml_use_trtllm_serve_names(role: str) -> None:
    spec = TrtllmBackend().launch_spec(cfg(role=role))
    assert spec.argv[0] == "/opt/trt/bin/trtllm-serve" and spec.argv[1] == "/models/llama"
    flags = [a for a in spec.argv[2:] if a.startswith("--")]
    unknown = set(flags) - set(SURFACE["trtllm_serve_options"])
    assert not unknown, f"flags trtllm-serve does not have ({SURFACE_SOURCE}): {unknown}"
    args = dict(zip(spec.argv[2::2], spec.argv[3::2]))
    assert (args["--port"], args["--max_seq_len"], args["--max_batch_size"], args["--max_num_tokens"]) == ("8300", "4096", "64", "8192")
    (path, text), = spec.files.items()
    assert args["--extra_llm_api_options"] == path
    options = yaml.safe_load(text)
    check_options(options)
    assert options["kv_cache_config"] == {"enable_block_reuse": True, "event_buffer_max_size": 10000, "tokens_per_block": 32}
    assert options["return_perf_metrics"] is True and options["enable_iter_perf_stats"] is True
    assert ("cache_transceiver_config" in options) == (role != "both")


def test_users_options_file_is_merged_under_its_keys(tmp_path: Path) -> None:
    user = tmp_path / "mine.yaml"
    user.write_text(yaml.safe_dump({"kv_cache_config": {"free_gpu_memory_fraction": 0.8, "tokens_per_block": 64},
                                    "cache_transceiver_config": {"backend": "NIXL", "max_tokens_in_buffer": 4096}}))
    spec = TrtllmBackend().launch_spec(cfg(role="prefill", extra_args=["--extra_llm_api_options", str(user), "--tp_size", "2"]))
    assert spec.argv.count("--extra_llm_api_options") == 1 and spec.argv[-2:] == ["--tp_size", "2"]
    options = yaml.safe_load(next(iter(spec.files.values())))
    check_options(options)
    assert options["kv_cache_config"] == {"enable_block_reuse": True, "event_buffer_max_size": 10000, "tokens_per_block": 64,
                                          "free_gpu_memory_fraction": 0.8}
    assert options["cache_transceiver_config"] == {"backend": "NIXL", "max_tokens_in_buffer": 4096}
    spec = TrtllmBackend().launch_spec(cfg(extra_args=[f"--config={user}"]))  # the other spelling, = form
    assert "--config" not in " ".join(spec.argv) and yaml.safe_load(next(iter(spec.files.values())))["kv_cache_config"]["tokens_per_block"] == 64


@pytest.mark.parametrize("extra, message", [
    (["--extra_llm_api_options"], "needs a file"),
    (["--extra_llm_api_options", "/nonexistent/x.yaml"], "cannot read"),
])
def test_bad_user_options_are_refused(extra: list[str], message: str) -> None:
    with pytest.raises(TrtllmLaunchError, match=message):
        TrtllmBackend().launch_spec(cfg(extra_args=extra))


def test_engine_cmd_replaces_only_the_program() -> None:
    spec = TrtllmBackend().launch_spec(cfg(engine_cmd=["python", "-m", "workers.sim", "--flavor", "trtllm"]))
    assert spec.argv[:6] == ["python", "-m", "workers.sim", "--flavor", "trtllm", "/models/llama"]


def test_merge_options_is_deep_and_user_wins() -> None:
    assert merge_options({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"c": 9}, "e": 4}) == {"a": {"b": 1, "c": 9}, "d": 3, "e": 4}
    assert llm_api_options(cfg(role="decode"))["cache_transceiver_config"] == {"backend": "DEFAULT"}


def test_registered_and_scrapes_the_prometheus_endpoint() -> None:
    b = get_backend("trtllm")
    assert b.metrics_path == "/prometheus/metrics" and b.kv_events_transport == "http-relay"
    text = ('# HELP trtllm_num_requests_running x\ntrtllm_num_requests_running{model_name="m"} 3.0\n'
            'trtllm_num_requests_waiting{model_name="m"} 2.0\ntrtllm_kv_cache_utilization{model_name="m"} 0.25\n'
            'trtllm_kv_cache_utilization{model_name="m"} NaN\n')
    m = b.parse_metrics(text)
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_usage) == (3.0, 2.0, 0.25)
    stats = json.dumps([{"numActiveRequests": 1, "numQueuedRequests": 4, "kvCacheStats": {"maxNumBlocks": 10, "usedNumBlocks": 5}}])
    m = parse_trtllm_metrics(stats)
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_usage) == (1.0, 4.0, 0.5)
    for junk in ("garbage {", "", "[1, 2]", None):
        m = parse_trtllm_metrics(junk)  # type: ignore[arg-type]
        assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_usage) == (0.0, 0.0, 0.0)


# ---- the relay: one reader of the drain-on-read endpoint, republishing in vLLM's format ------------------


class _Published(list):
    def publish(self, events):
        self.append(list(events))


def relay(max_bad_polls: int = 3) -> KvEventRelay:
    r = KvEventRelay("http://127.0.0.1:1", RelaySettings("tcp://127.0.0.1:0"), max_bad_polls=max_bad_polls, log_interval_s=0)
    r.publisher = _Published()  # type: ignore[assignment]
    return r


def test_relay_republishes_and_marks_gaps() -> None:
    r = relay()
    stored = BlockStored([11, 12], None, [1, 2, 3, 4], 2)
    assert r.handle(encode_events([(0, stored), (1, BlockRemoved([11]))])) == 2
    assert r.handle(encode_events([(5, BlockRemoved([12]))])) == 2  # events 2..4 lost: a clear first
    assert r.handle(b"[]") == 0
    (first, second) = r.publisher
    assert [type(e) for e in first] == [BlockStored, BlockRemoved] and first[0].block_hashes == [11, 12]
    assert isinstance(second[0], AllBlocksCleared) and second[1].block_hashes == [12]
    assert r.stats() == {"events": 4, "undecodable": 0, "gaps": 1, "last_error": "events 2..4 were lost: cache view reset"}


def test_relay_skips_bad_events_and_gives_up_on_an_engine_that_never_decodes() -> None:
    r = relay(max_bad_polls=3)
    mixed = msgspec.json.encode([{"event_id": "x"}, *msgspec.json.decode(encode_events([(0, BlockRemoved([1]))]))])
    assert r.handle(mixed) == 1 and r.undecodable == 1
    bad = b'{"not": "a list"}'
    r.handle(bad)
    r.handle(bad)
    with pytest.raises(KvRelayError, match="3 polls .* nothing decodable"):
        r.handle(bad)


async def test_relay_publishes_vllm_frames_that_subscribers_decode(tmp_path: Path) -> None:
    import zmq
    import zmq.asyncio

    endpoint = f"ipc://{tmp_path}/relay.sock"
    r = KvEventRelay("http://127.0.0.1:1", RelaySettings(endpoint, f"ipc://{tmp_path}/replay.sock", topic="kv"))
    r.start()
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(r.replay_endpoint)
    try:
        r.handle(encode_events([(0, BlockStored([7], None, [1, 2], 2))]))
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # replay from 0: what a frontend does on connect
        _, topic, seq, payload = await dealer.recv_multipart()
        batch = decode_payload(payload, int.from_bytes(seq, "big"))
        assert topic == b"kv" and batch.seq == 0 and batch.events[0].block_hashes == [7]
    finally:
        dealer.close(0)
        ctx.term()
        await r.close()
