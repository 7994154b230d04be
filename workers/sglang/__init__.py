"""SGLang backend pieces. For now: its KV-event wire format (decoded by the router's ingestor)."""

from workers.sglang.kv_events import decode_payload, decode_pub_frames, decode_replay_frames, encode_batch

__all__ = ["decode_payload", "decode_pub_frames", "decode_replay_frames", "encode_batch"]
