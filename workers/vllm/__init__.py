"""vLLM backend: launch, metrics parsing, block hashing and KV-event decoding for vLLM servers."""

from workers.vllm.backend import VllmBackend, VllmLaunchError, VllmNotInstalledError, find_vllm_python
from workers.vllm.hashing import vllm_block_hashes
from workers.vllm.kv_events import decode_payload, decode_pub_frames, decode_replay_frames, encode_batch
from workers.vllm.metrics import parse_vllm_metrics

__all__ = [
    "VllmBackend",
    "VllmLaunchError",
    "VllmNotInstalledError",
    "decode_payload",
    "decode_pub_frames",
    "decode_replay_frames",
    "encode_batch",
    "find_vllm_python",
    "parse_vllm_metrics",
    "vllm_block_hashes",
]
