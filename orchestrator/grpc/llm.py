"""The LLM tensor convention of Triton's vLLM backend and Dynamo's KServe frontend, as pure functions.

    request  text_input           BYTES [1]  the prompt (UTF-8)                       required
             stream               BOOL  [1]  many responses (ModelStreamInfer only)   default false
             sampling_parameters  BYTES [1]  JSON object, e.g. {"max_tokens": 16, "temperature": 0}
             exclude_input_in_output BOOL [1] false: the unary text starts with the prompt  default true
             <sampling name>      scalar     e.g. max_tokens INT32 [1] (TensorRT-LLM ensemble style)
             parameters{...}      request parameters with sampling names (max_tokens, temperature, ...)
    response text_output          BYTES [1]  the delta per streamed response, the whole text otherwise
             parameters           prompt_tokens, completion_tokens, finish_reason; streamed responses
                                  also carry triton_final_response (true on the last one)

Sampling values may be strings ("0.7"), as Triton's examples send them; each is coerced to its type.
Precedence (later wins): sampling_parameters < request parameters < scalar input tensors.
Everything here raises BadRequestError (-> INVALID_ARGUMENT) naming the tensor or parameter.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from orchestrator.errors import BadRequestError
from orchestrator.json_input import load_json
from orchestrator.grpc.generated import pb

__all__ = ["completion_body", "lenient", "Undecodable", "decode_bytes_tensor", "encode_bytes_tensor", "text_response", "set_param", "params_dict",
           "INPUTS", "OUTPUT", "FINAL_FLAG"]

OUTPUT = "text_output"
FINAL_FLAG = "triton_final_response"
INPUTS = (("text_input", "BYTES", [1]), ("stream", "BOOL", [1]), ("sampling_parameters", "BYTES", [1]),
          ("exclude_input_in_output", "BOOL", [1]))
# Request parameters that belong to the protocol (tritonclient sets some itself), not to sampling.
_RESERVED = {"triton_enable_empty_final_response", "sequence_id", "sequence_start", "sequence_end", "priority",
             "timeout", "binary_data_output", "headers"}


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, (str, bytes)) and (s := (v.decode() if isinstance(v, bytes) else v).strip().lower()) in ("true", "false", "1", "0"):
        return s in ("true", "1")
    raise ValueError("expected a boolean")


def _int(v: Any) -> int:
    if isinstance(v, bool):
        raise ValueError("expected an integer")
    if isinstance(v, float):
        if not v.is_integer():
            raise ValueError(f"expected an integer, got {v}")
        return int(v)
    return int(v.decode() if isinstance(v, bytes) else v)


def _float(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError("expected a number")
    return float(v.decode() if isinstance(v, bytes) else v)


def _stop(v: Any) -> str | list[str]:
    if isinstance(v, bytes):
        v = v.decode()
    if isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        return v
    raise ValueError("expected a string or a list of strings")


_SAMPLING: dict[str, Callable[[Any], Any]] = {
    "max_tokens": _int, "min_tokens": _int, "n": _int, "seed": _int, "top_k": _int,
    "temperature": _float, "top_p": _float, "min_p": _float, "presence_penalty": _float,
    "frequency_penalty": _float, "repetition_penalty": _float,
    "ignore_eos": _bool, "skip_special_tokens": _bool, "include_stop_str_in_output": _bool, "stop": _stop,
}


def decode_bytes_tensor(raw: bytes) -> list[bytes]:
    """BYTES raw contents: each element is a 4-byte little-endian length, then that many bytes."""
    out, i = [], 0
    while i < len(raw):
        if i + 4 > len(raw):
            raise ValueError("truncated BYTES element length")
        (n,) = struct.unpack_from("<I", raw, i)
        if i + 4 + n > len(raw):
            raise ValueError("BYTES element longer than the tensor data")
        out.append(raw[i + 4:i + 4 + n])
        i += 4 + n
    return out


def encode_bytes_tensor(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def _values(req: pb.ModelInferRequest, index: int) -> list[Any]:
    t = req.inputs[index]
    dt = t.datatype.upper()
    if req.raw_input_contents:
        if index >= len(req.raw_input_contents):
            raise ValueError("raw_input_contents has fewer entries than inputs")
        raw = req.raw_input_contents[index]
        if dt == "BYTES":
            return decode_bytes_tensor(raw)
        fmt = {"BOOL": "?", "INT8": "b", "INT16": "h", "INT32": "i", "INT64": "q", "UINT8": "B", "UINT16": "H",
               "UINT32": "I", "UINT64": "Q", "FP32": "f", "FP64": "d"}.get(dt)
        if fmt is None:
            raise ValueError(f"unsupported datatype {t.datatype!r}")
        size = struct.calcsize(fmt)
        if len(raw) % size:
            raise ValueError(f"raw contents of {len(raw)} bytes do not fit {dt} elements")
        return list(struct.unpack(f"<{len(raw) // size}{fmt}", raw))
    c = t.contents
    field = {"BYTES": c.bytes_contents, "BOOL": c.bool_contents, "INT64": c.int64_contents, "UINT64": c.uint64_contents,
             "FP32": c.fp32_contents, "FP64": c.fp64_contents}.get(dt)
    if field is None:
        field = c.int_contents if dt in ("INT8", "INT16", "INT32") else c.uint_contents if dt in ("UINT8", "UINT16", "UINT32") else None
    if field is None:
        raise ValueError(f"unsupported datatype {t.datatype!r}")
    return list(field)


def _scalar(req: pb.ModelInferRequest, index: int) -> Any:
    name = req.inputs[index].name
    try:
        vals = _values(req, index)
    except ValueError as exc:
        raise BadRequestError(f"input tensor '{name}': {exc}", param=name) from exc
    if len(vals) != 1:
        raise BadRequestError(f"input tensor '{name}' must hold exactly one element (shape [1]); got {len(vals)}", param=name)
    return vals[0]


def _param_value(p: pb.InferParameter) -> Any:
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


def _sampling(name: str, value: Any, where: str) -> Any:
    conv = _SAMPLING.get(name)
    if conv is None:
        raise BadRequestError(f"{where} '{name}' is not a supported sampling parameter "
                              f"(supported: {', '.join(sorted(_SAMPLING))})", param=name)
    try:
        return conv(value)
    except (TypeError, ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"{where} '{name}': {exc}", param=name) from exc


class Undecodable:
    """A request message protobuf could not parse (e.g. a string field holding invalid UTF-8): the server's lenient
    deserializer (orchestrator/grpc/server.py) hands this to the servicer, which answers INVALID_ARGUMENT."""

    model_name = model_version = id = ""

    def __init__(self, why: str) -> None:
        self.why = why


def lenient(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # google.protobuf.message.DecodeError, and anything else a bad message raises
            return Undecodable(f"{type(exc).__name__}: {exc}")
    return parse


def completion_body(req: pb.ModelInferRequest) -> tuple[dict[str, Any], bool, bool]:
    """A KServe request -> (OpenAI /v1/completions body, stream?, prepend the prompt to unary text?)."""
    if isinstance(req, Undecodable):
        raise BadRequestError(f"the request message cannot be parsed ({req.why})")
    if not req.model_name:
        raise BadRequestError("model_name is required", param="model")
    found: dict[str, Any] = {}
    for i, t in enumerate(req.inputs):
        if t.name in found:
            raise BadRequestError(f"input tensor '{t.name}' given twice", param=t.name)
        if t.name not in {n for n, _, _ in INPUTS} and t.name not in _SAMPLING:
            raise BadRequestError(f"unknown input tensor '{t.name}' (expected text_input, stream, sampling_parameters, "
                                  "exclude_input_in_output or a sampling parameter)", param=t.name)
        found[t.name] = _scalar(req, i)
    for o in req.outputs:
        if o.name != OUTPUT:
            raise BadRequestError(f"unknown output tensor '{o.name}' (this model has only '{OUTPUT}')", param=o.name)
    if "text_input" not in found:
        raise BadRequestError("input tensor 'text_input' (BYTES, shape [1]) is required", param="text_input")
    text = found.pop("text_input")
    try:
        prompt = text.decode("utf-8") if isinstance(text, bytes) else str(text)
        stream = _bool(found.pop("stream", False))
        exclude = _bool(found.pop("exclude_input_in_output", True))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequestError(f"bad text_input, stream or exclude_input_in_output: {exc}") from exc
    sampling: dict[str, Any] = {}
    if "sampling_parameters" in found:
        try:
            js = load_json(found.pop("sampling_parameters") or b"{}", "input tensor 'sampling_parameters'")
        except BadRequestError as exc:
            exc.param = "sampling_parameters"
            raise
        if not isinstance(js, dict):
            raise BadRequestError("input tensor 'sampling_parameters' must be a JSON object", param="sampling_parameters")
        sampling.update({k: _sampling(k, v, "sampling parameter") for k, v in js.items()})
    for k, p in req.parameters.items():
        if k not in _RESERVED and not k.startswith("triton_"):
            sampling[k] = _sampling(k, _param_value(p), "request parameter")
    sampling.update({k: _sampling(k, v, "input tensor") for k, v in found.items()})
    if sampling.get("n", 1) != 1:
        raise BadRequestError("n must be 1: a response carries one text_output", param="n")
    body = {"model": req.model_name, "prompt": prompt, **sampling}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body, stream, not exclude


def set_param(params, key: str, value: Any) -> None:
    """Set one entry of a protobuf `map<string, InferParameter>` from a Python value."""
    if isinstance(value, bool):
        params[key].bool_param = value
    elif isinstance(value, int):
        params[key].int64_param = value
    elif isinstance(value, float):
        params[key].double_param = value
    else:
        params[key].string_param = str(value)


def params_dict(params) -> dict[str, Any]:
    return {k: _param_value(v) for k, v in params.items()}


def text_response(model: str, version: str, request_id: str, text: str, params: dict[str, Any]) -> pb.ModelInferResponse:
    """One response carrying `text_output` (raw BYTES form, as Triton sends it) and `params`."""
    resp = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    resp.outputs.add(name=OUTPUT, datatype="BYTES", shape=[1])
    resp.raw_output_contents.append(encode_bytes_tensor([text.encode("utf-8")]))
    for k, v in params.items():
        if v is not None:
            set_param(resp.parameters, k, v)
    return resp
