"""vLLM backend: launch, request shaping, metrics parsing and KV-event decoding for vLLM servers."""

from workers.vllm.kv_events import decode_payload, decode_pub_frames, decode_replay_frames, encode_batch

__all__ = ["decode_payload", "decode_pub_frames", "decode_replay_frames", "encode_batch"]
