"""API keys and per-key rate limits on the KServe v2 gRPC endpoint (tritonclient + raw grpcio), in process."""

from __future__ import annotations

import logging

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest
import tritonclient.grpc.aio as tgrpc
from tritonclient.grpc import InferInput
from tritonclient.grpc import service_pb2 as triton_pb
from tritonclient.utils import InferenceServerException

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from orchestrator.security import KeyFile, generate_key, save_key_file
from workers.discovery import InMemoryDiscovery

from orchestrator.testing import FakeEngine, free_port, winfo

INFER = "/inference.GRPCInferenceService/ModelInfer"


def _inputs(stream: bool | None = None) -> list[InferInput]:
    out = [InferInput("text_input", [1], "BYTES")]
    out[0].set_data_from_numpy(np.array([b"hello"], dtype=object))
    if stream is not None:
        out.append(InferInput("stream", [1], "BOOL"))
        out[-1].set_data_from_numpy(np.array([stream]))
    return out


@pytest.fixture
async def grpc_stack(tmp_path):
    keys, records = {}, []
    for name, lim in (("open", {}), ("limited", {"rpm": 2}), ("revoked", {})):
        k, rec = generate_key(name, **lim)
        rec.revoked_at = 1.0 if name == "revoked" else None
        keys[name], _ = k, records.append(rec)
    save_key_file(tmp_path / "keys.yaml", KeyFile(keys=records))
    port = free_port()
    disc = InMemoryDiscovery()
    app = create_app(FrontendConfig(grpc_port=port, refresh_interval_s=60, security={"api_keys_file": tmp_path / "keys.yaml"}, resilience={"retry_after_s": 2}), disc)
    async with app.router.lifespan_context(app):
        with FakeEngine(tokens=3) as eng:
            await disc.register(winfo("a", eng.url), ttl_s=60)
            await app.state.pool.refresh()
            client = tgrpc.InferenceServerClient(f"127.0.0.1:{port}")
            try:
                yield app, client, keys, port, eng
            finally:
                await client.close()


def auth(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


async def test_keys_guard_model_and_inference_rpcs(grpc_stack):
    app, c, keys, _, eng = grpc_stack
    assert await c.is_server_live() and await c.is_server_ready()  # probes stay open
    for call in (lambda h: c.is_model_ready("m", headers=h), lambda h: c.get_model_metadata("m", headers=h),
                 lambda h: c.infer("m", _inputs(), headers=h)):
        for headers in (None, auth("kvy_0123456789ab_" + "x" * 43), auth(keys["revoked"]), {"x-api-key": "sk-nope"}):
            with pytest.raises(InferenceServerException) as ei:
                await call(headers)
            assert ei.value.status() == "StatusCode.UNAUTHENTICATED", ei.value
    assert eng.requests == []
    assert await c.is_model_ready("m", headers=auth(keys["open"]))
    assert (await c.infer("m", _inputs(), headers={"x-api-key": keys["open"]})).as_numpy("text_output").tolist() == [b"xxx"]
    assert "authorization" not in eng.requests[0]["headers"]


async def test_rate_limit_is_resource_exhausted_with_retry_after(grpc_stack):
    app, c, keys, port, eng = grpc_stack
    for _ in range(2):
        await c.infer("m", _inputs(), headers=auth(keys["limited"]))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.unary_unary(INFER, request_serializer=triton_pb.ModelInferRequest.SerializeToString,
                              response_deserializer=triton_pb.ModelInferResponse.FromString)
        req = triton_pb.ModelInferRequest(model_name="m")
        req.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"x")
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await call(req, metadata=(("authorization", f"Bearer {keys['limited']}"),))
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "requests per minute" in ei.value.details()
    md = dict(ei.value.trailing_metadata())
    assert md["x-kvyard-error-code"] == "rate_limit_exceeded" and int(md["retry-after"]) >= 1
    assert len(eng.requests) == 2
    text = generate_latest(app.state.metrics.registry).decode()
    assert f'kvyard_rate_limited_total{{key_id="{keys["limited"].split("_")[1]}",limit="requests"}} 1.0' in text


async def test_stream_needs_a_key_and_limits_each_request(grpc_stack):
    app, c, keys, _, eng = grpc_stack

    async def requests(n: int):
        for i in range(n):
            yield {"model_name": "m", "inputs": _inputs(stream=True), "request_id": f"r{i}"}

    with pytest.raises((InferenceServerException, grpc.aio.AioRpcError)) as ei:  # tritonclient's aio stream raises grpc's own
        [x async for x in c.stream_infer(requests(1))]
    assert "UNAUTHENTICATED" in str(ei.value) and "API key" in str(ei.value)
    got = [x async for x in c.stream_infer(requests(3), headers=auth(keys["limited"]))]
    errors = [str(err) for _, err in got if err is not None]
    finals = [r for r, err in got if err is None and r.get_response().parameters["triton_final_response"].bool_param]
    assert len(finals) == 2 and len(errors) == 1 and "rate_limit_exceeded" in errors[0], errors
    assert len(eng.requests) == 2


async def test_grpc_auth_failures_leave_no_key_in_logs(grpc_stack, caplog):
    caplog.set_level(logging.DEBUG)
    app, c, keys, _, _ = grpc_stack
    wrong = keys["open"][:-3] + "zzz"
    with pytest.raises(InferenceServerException):
        await c.infer("m", _inputs(), headers=auth(wrong))
    with pytest.raises(InferenceServerException):
        await c.infer("m", _inputs(), headers=auth(keys["revoked"]))
    assert "grpc: refused an API key (invalid" in caplog.text
    for k in (wrong, keys["revoked"], keys["open"]):
        assert k.split("_", 2)[2] not in caplog.text
