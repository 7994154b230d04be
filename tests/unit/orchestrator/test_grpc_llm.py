"""The gRPC endpoint's pure parts: Triton's LLM tensor convention, BYTES framing, status mapping.

Requests are built by the real third-party client (tritonclient's InferInput and request builder),
serialized, and parsed with kvyard's own stubs -- the same bytes the server receives.
"""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.grpc._infer_result import InferResult
from tritonclient.grpc._utils import _get_inference_request
from tritonclient.grpc import service_pb2 as triton_pb

from orchestrator.errors import BadRequestError, KvyardError, RateLimitError, ServiceUnavailableError
from orchestrator.grpc.generated import pb
from orchestrator.grpc.llm import completion_body, decode_bytes_tensor, encode_bytes_tensor, params_dict, text_response
from orchestrator.grpc.status import engine_error, grpc_code, trailing_metadata


_NP = {"BYTES": object, "BOOL": bool, "INT32": np.int32, "INT64": np.int64, "FP32": np.float32}


def tensor(name: str, value, datatype: str) -> InferInput:
    t = InferInput(name, [1], datatype)
    t.set_data_from_numpy(np.array([value], dtype=_NP[datatype]))
    return t


def request(inputs, parameters=None, outputs=None, model="m") -> pb.ModelInferRequest:
    req = _get_inference_request(model_name=model, inputs=inputs, model_version="", request_id="r1", outputs=outputs,
                                 sequence_id=0, sequence_start=False, sequence_end=False, priority=0, timeout=None,
                                 parameters=parameters)
    return pb.ModelInferRequest.FromString(req.SerializeToString())


def text(s: str = "hello") -> InferInput:
    return tensor("text_input", s.encode(), "BYTES")


@pytest.mark.parametrize("items", [[], [b""], [b"a"], ["héllo ✓".encode(), b"", b"x" * 70000]])
def test_bytes_tensor_roundtrip(items):
    assert decode_bytes_tensor(encode_bytes_tensor(items)) == items


@pytest.mark.parametrize("raw", [b"\x05\x00\x00", b"\x05\x00\x00\x00abc"])
def test_bytes_tensor_truncated(raw):
    with pytest.raises(ValueError):
        decode_bytes_tensor(raw)


@pytest.mark.parametrize(
    "inputs, parameters, expected",
    [
        ([text()], None, {"model": "m", "prompt": "hello"}),
        ([text("héllo ✓")], None, {"model": "m", "prompt": "héllo ✓"}),
        ([text(), tensor("sampling_parameters", b'{"max_tokens": 16, "temperature": 0}', "BYTES")], None,
         {"model": "m", "prompt": "hello", "max_tokens": 16, "temperature": 0.0}),
        # Triton's vLLM examples send the values as strings
        ([text(), tensor("sampling_parameters", b'{"max_tokens": "8", "top_p": "0.95", "ignore_eos": "true"}', "BYTES")], None,
         {"model": "m", "prompt": "hello", "max_tokens": 8, "top_p": 0.95, "ignore_eos": True}),
        ([text()], {"max_tokens": 4, "temperature": "0.5", "stop": "\n"},
         {"model": "m", "prompt": "hello", "max_tokens": 4, "temperature": 0.5, "stop": "\n"}),
        # precedence: sampling_parameters < request parameters < scalar tensors
        ([text(), tensor("sampling_parameters", b'{"max_tokens": 1}', "BYTES"), tensor("max_tokens", 3, "INT32")],
         {"max_tokens": 2}, {"model": "m", "prompt": "hello", "max_tokens": 3}),
        ([text(), tensor("max_tokens", 7, "INT64"), tensor("temperature", 0.25, "FP32")], None,
         {"model": "m", "prompt": "hello", "max_tokens": 7, "temperature": 0.25}),
        # protocol parameters set by tritonclient itself are not sampling parameters
        ([text()], {"triton_enable_empty_final_response": True}, {"model": "m", "prompt": "hello"}),
    ],
)
def test_completion_body(inputs, parameters, expected):
    body, stream, prepend = completion_body(request(inputs, parameters))
    assert body == expected and stream is False and prepend is False


def test_stream_asks_for_usage_and_prompt_prepend():
    body, stream, prepend = completion_body(request([text(), tensor("stream", True, "BOOL"),
                                                     tensor("exclude_input_in_output", False, "BOOL")]))
    assert stream and prepend
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_contents_form_is_read_too():
    """Clients other than tritonclient may send typed `contents` instead of raw bytes."""
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"hi")
    req.inputs.add(name="stream", datatype="BOOL", shape=[1]).contents.bool_contents.append(True)
    req.inputs.add(name="max_tokens", datatype="INT32", shape=[1]).contents.int_contents.append(5)
    body, stream, _ = completion_body(req)
    assert body == {"model": "m", "prompt": "hi", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize(
    "inputs, parameters, outputs, param",
    [
        ([], None, None, "text_input"),
        ([tensor("stream", True, "BOOL")], None, None, "text_input"),
        ([text(), tensor("sampling_parameters", b"{not json", "BYTES")], None, None, "sampling_parameters"),
        ([text(), tensor("sampling_parameters", b"[1]", "BYTES")], None, None, "sampling_parameters"),
        ([text(), tensor("sampling_parameters", b'{"max_tokens": "many"}', "BYTES")], None, None, "max_tokens"),
        ([text(), tensor("sampling_parameters", b'{"max_tokens": 2.5}', "BYTES")], None, None, "max_tokens"),
        ([text(), tensor("sampling_parameters", b'{"beam_width": 2}', "BYTES")], None, None, "beam_width"),
        ([text()], {"temperature": "hot"}, None, "temperature"),
        ([text()], {"prompt": "override"}, None, "prompt"),
        ([text(), tensor("image", b"x", "BYTES")], None, None, "image"),
        ([text()], None, [InferRequestedOutput("logits")], "logits"),
    ],
)
def test_bad_requests_name_the_culprit(inputs, parameters, outputs, param):
    with pytest.raises(BadRequestError) as ei:
        completion_body(request(inputs, parameters, outputs))
    assert ei.value.param == param and ei.value.message


def test_text_input_must_be_one_element():
    t = InferInput("text_input", [2], "BYTES")
    t.set_data_from_numpy(np.array([b"a", b"b"], dtype=object))
    with pytest.raises(BadRequestError, match="exactly one element"):
        completion_body(request([t]))


def test_text_response_reads_back_with_tritonclient():
    resp = text_response("m", "1", "r1", "héllo", {"prompt_tokens": 3, "completion_tokens": 2, "finish_reason": "length",
                                                   "triton_final_response": True, "skipped": None})
    result = InferResult(triton_pb.ModelInferResponse.FromString(resp.SerializeToString()))
    assert result.as_numpy("text_output").tolist() == ["héllo".encode()]
    assert params_dict(resp.parameters) == {"prompt_tokens": 3, "completion_tokens": 2, "finish_reason": "length",
                                            "triton_final_response": True}
    assert result.get_response().id == "r1"


@pytest.mark.parametrize(
    "status, code",
    [(400, grpc.StatusCode.INVALID_ARGUMENT), (401, grpc.StatusCode.UNAUTHENTICATED), (404, grpc.StatusCode.NOT_FOUND),
     (413, grpc.StatusCode.RESOURCE_EXHAUSTED), (422, grpc.StatusCode.INVALID_ARGUMENT), (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
     (500, grpc.StatusCode.INTERNAL), (502, grpc.StatusCode.UNAVAILABLE), (503, grpc.StatusCode.UNAVAILABLE),
     (504, grpc.StatusCode.DEADLINE_EXCEEDED)],
)
def test_status_codes(status, code):
    assert grpc_code(status) == code


def test_trailing_metadata_carries_type_code_and_retry_after():
    md = dict(trailing_metadata(ServiceUnavailableError("busy", retry_after=1.6)))
    assert md == {"x-kvyard-error-type": "service_unavailable", "x-kvyard-error-code": "no_capacity", "retry-after": "2"}
    assert "retry-after" not in dict(trailing_metadata(RateLimitError("slow down")))


@pytest.mark.parametrize(
    "body, message",
    [
        (json.dumps({"error": {"message": "boom", "type": "BadRequestError", "code": 400}}).encode(), "boom"),
        (json.dumps({"object": "error", "message": "old vLLM shape", "code": 400}).encode(), "old vLLM shape"),
        (b"<html>nope</html>", "the engine refused the request (HTTP 400)"),
    ],
)
def test_engine_error_message(body, message):
    exc = engine_error(400, body)
    assert isinstance(exc, KvyardError) and exc.status == 400 and exc.message == message


def test_committed_stubs_match_the_proto(tmp_path):
    """scripts/gen_protos.sh regenerates exactly what is committed (edit the .proto, then run the script)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    proc = subprocess.run(["bash", str(repo / "scripts" / "gen_protos.sh"), str(tmp_path)], env={"PY": sys.executable, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    committed = repo / "orchestrator" / "grpc" / "generated"
    for name in ("grpc_service_pb2.py", "grpc_service_pb2.pyi", "grpc_service_pb2_grpc.py"):
        assert (tmp_path / name).read_text() == (committed / name).read_text(), f"{name} is stale: run scripts/gen_protos.sh"


@pytest.mark.parametrize("argv, yaml_text, port", [
    (["frontend"], None, 8001),
    (["frontend", "--grpc-port", "0"], None, 0),
    (["up", "--grpc-port", "9101"], None, 9101),
    (["frontend"], "frontend:\n  grpc_port: 9100\n", 9100),
    (["frontend", "--grpc-port", "9102"], "frontend:\n  grpc_port: 9100\n", 9102),
])
def test_cli_grpc_port(tmp_path, argv, yaml_text, port):
    from orchestrator.cli import build_parser, cluster_config, frontend_config

    if yaml_text is not None:
        (tmp_path / "c.yaml").write_text(yaml_text)
        argv = [*argv, "--config", str(tmp_path / "c.yaml")]
    ns = build_parser().parse_args(argv)
    cfg = cluster_config(ns).frontend if argv[0] == "up" else frontend_config(ns)
    assert cfg.grpc_port == port
