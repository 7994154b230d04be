"""Disaggregated prefill/decode on the frontend: the conditional decision (pure) and the coordinator
that routes both phases and runs each engine's hand-off (vLLM, SGLang, TensorRT-LLM)."""

from orchestrator.disagg.coordinator import PROTOCOLS, BufferedResponse, DisaggCoordinator, PrefillFailed, protocol_of
from orchestrator.disagg.decision import DisaggDecision, decide

__all__ = ["PROTOCOLS", "BufferedResponse", "DisaggCoordinator", "DisaggDecision", "PrefillFailed", "decide", "protocol_of"]
