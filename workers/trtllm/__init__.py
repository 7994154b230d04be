"""TensorRT-LLM backend pieces. For now: its KV-event JSON (polled and decoded by the router's ingestor)."""

from workers.trtllm.kv_events import KV_EVENTS_PATH, decode_event, decode_events, encode_events

__all__ = ["KV_EVENTS_PATH", "decode_event", "decode_events", "encode_events"]
