"""The gRPC endpoint through the real app lifespan, spoken to by tritonclient.grpc.aio, over fake engines.

State RPCs, ModelInfer, ModelStreamInfer (many responses + final flag, several requests on one stream),
the error table (status codes and the stream's error_message), cancellation reaching the engine,
router bookkeeping, metrics, health checking and reflection.
"""

from __future__ import annotations

import asyncio
import socket

import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as tgrpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import InferInput
from tritonclient.grpc import service_pb2 as triton_pb
from tritonclient.utils import InferenceServerException

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from orchestrator.grpc import GrpcStartError, start_grpc_server
from workers.discovery import InMemoryDiscovery
from workers.types import WorkerState

from orchestrator.testing import FakeEngine, free_port, winfo

STREAM_RPC = "/inference.GRPCInferenceService/ModelStreamInfer"


class Stack:
    def __init__(self, app, disc: InMemoryDiscovery, client: tgrpc.InferenceServerClient, port: int) -> None:
        self.app, self.disc, self.client, self.port = app, disc, client, port

    async def add(self, *infos) -> None:
        for i in infos:
            await self.disc.register(i, ttl_s=60)
        await self.app.state.pool.refresh()

    def inflight(self, wid: str) -> int:
        return self.app.state.router.loads.load(wid).inflight_requests


@pytest.fixture
async def stack():
    disc = InMemoryDiscovery()
    port = free_port()
    cfg = FrontendConfig(max_body_bytes=4096, refresh_interval_s=0.05, grpc_port=port, resilience={"retry_after_s": 2})
    app = create_app(cfg, disc)
    async with app.router.lifespan_context(app):
        assert app.state.grpc.port == port
        client = tgrpc.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            yield Stack(app, disc, client, port)
        finally:
            await client.close()
    assert app.state.grpc is None


def inputs(prompt: str = "hello", stream: bool | None = None, sampling: str | None = None) -> list[InferInput]:
    out = [InferInput("text_input", [1], "BYTES")]
    out[0].set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    if stream is not None:
        out.append(InferInput("stream", [1], "BOOL"))
        out[-1].set_data_from_numpy(np.array([stream]))
    if sampling is not None:
        out.append(InferInput("sampling_parameters", [1], "BYTES"))
        out[-1].set_data_from_numpy(np.array([sampling.encode()], dtype=object))
    return out


def params(result) -> dict:
    return {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in result.get_response().parameters.items()}


async def stream(client, *requests: dict) -> list[tuple]:
    async def gen():
        for r in requests:
            yield r
    return [x async for x in client.stream_infer(gen())]


async def test_state_rpcs_follow_the_pool(stack):
    c = stack.client
    assert await c.is_server_live() and not await c.is_server_ready() and not await c.is_model_ready("m")
    meta = await c.get_server_metadata(as_json=True)
    assert meta["name"] == "kvyard" and meta["version"]
    with FakeEngine() as eng:
        await stack.add(winfo("a", eng.url))
        assert await c.is_server_ready() and await c.is_model_ready("m") and await c.is_model_ready("m", "1")
        assert not await c.is_model_ready("m", "2") and not await c.is_model_ready("other")
        md = await c.get_model_metadata("m", as_json=True)
        assert md["versions"] == ["1"]
        assert {i["name"]: i["datatype"] for i in md["inputs"]}["text_input"] == "BYTES"
        assert [o["name"] for o in md["outputs"]] == ["text_output"]
        await stack.disc.set_state("a", WorkerState.DRAINING)
        await stack.app.state.pool.refresh()
        assert not await c.is_server_ready() and not await c.is_model_ready("m")


async def test_model_infer(stack):
    with FakeEngine(tokens=5) as eng:
        await stack.add(winfo("a", eng.url))
        r = await stack.client.infer("m", inputs(sampling='{"max_tokens": "3", "temperature": 0}'), request_id="abc",
                                     headers={"x-request-id": "trace-1"})
        assert r.as_numpy("text_output").tolist() == [b"xxx"]
        assert params(r) == {"prompt_tokens": 3, "completion_tokens": 3}
        assert r.get_response().id == "abc" and r.get_response().model_version == "1"
        sent = eng.requests[0]
        assert sent["body"] == {"model": "m", "prompt": "hello", "max_tokens": 3, "temperature": 0.0}
        assert sent["headers"]["x-request-id"] == "trace-1"
        assert stack.inflight("a") == 0


async def test_model_stream_infer_many_responses_then_final(stack):
    with FakeEngine(tokens=4) as eng:
        await stack.add(winfo("a", eng.url))
        got = await stream(stack.client, {"model_name": "m", "inputs": inputs(stream=True), "request_id": "s1"})
        assert all(err is None for _, err in got)
        results = [r for r, _ in got]
        assert [r.as_numpy("text_output").tolist() for r in results] == [[b"x"]] * 4 + [[b""]]
        assert [params(r)["triton_final_response"] for r in results] == [False] * 4 + [True]
        assert {k: params(results[-1])[k] for k in ("prompt_tokens", "completion_tokens")} == {"prompt_tokens": 3, "completion_tokens": 4}
        assert {r.get_response().id for r in results} == {"s1"}
        assert eng.requests[0]["body"]["stream_options"] == {"include_usage": True}
        assert stack.inflight("a") == 0


async def test_stream_rpc_several_requests_and_non_streamed_one(stack):
    with FakeEngine(tokens=3) as eng:
        await stack.add(winfo("a", eng.url))
        got = await stream(stack.client,
                           {"model_name": "m", "inputs": inputs(stream=True), "request_id": "a"},
                           {"model_name": "m", "inputs": inputs(stream=False), "request_id": "b"},
                           {"model_name": "nope", "inputs": inputs(stream=True), "request_id": "c"})
        by_id: dict[str, list] = {}
        for r, err in got:
            if err is not None:
                assert "`nope` does not exist" in err.message()
                by_id.setdefault("c", []).append(err)
            else:
                by_id.setdefault(r.get_response().id, []).append(r)
        assert len(by_id["a"]) == 4 and params(by_id["a"][-1])["triton_final_response"]
        assert len(by_id["b"]) == 1 and by_id["b"][0].as_numpy("text_output").tolist() == [b"xxx"]
        assert params(by_id["b"][0])["triton_final_response"] and params(by_id["b"][0])["completion_tokens"] == 3
        assert len(by_id["c"]) == 1


@pytest.mark.parametrize(
    "model, sampling, req_params, status, needle",
    [
        ("nope", None, None, "StatusCode.NOT_FOUND", "`nope` does not exist"),
        ("m", '{"max_tokens": -1}', None, "StatusCode.INVALID_ARGUMENT", "max_tokens"),
        ("m", None, {"max_tokens": 10**6}, "StatusCode.INVALID_ARGUMENT", "maximum context length"),
        ("m", None, {"n": 2}, "StatusCode.INVALID_ARGUMENT", "n"),
        ("m", None, {"beam_width": 2}, "StatusCode.INVALID_ARGUMENT", "beam_width"),
        ("m", "{oops", None, "StatusCode.INVALID_ARGUMENT", "sampling_parameters"),
    ],
)
async def test_errors_map_to_status_codes(stack, model, sampling, req_params, status, needle):
    with FakeEngine() as eng:
        await stack.add(winfo("a", eng.url))
        with pytest.raises(InferenceServerException) as ei:
            await stack.client.infer(model, inputs(sampling=sampling), parameters=req_params)
        assert ei.value.status() == status and needle in ei.value.message()
        assert not eng.requests  # refused before reaching any engine


async def test_oversized_prompt_and_stream_flag_on_unary(stack):
    with FakeEngine() as eng:
        await stack.add(winfo("a", eng.url))
        with pytest.raises(InferenceServerException) as ei:
            await stack.client.infer("m", inputs("x" * 5000))
        assert ei.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        with pytest.raises(InferenceServerException) as ei:
            await stack.client.infer("m", inputs(stream=True))
        assert ei.value.status() == "StatusCode.INVALID_ARGUMENT" and "ModelStreamInfer" in ei.value.message()
        with pytest.raises(InferenceServerException) as ei:
            await stack.client.infer("m", inputs(), model_version="7")
        assert ei.value.status() == "StatusCode.NOT_FOUND"


async def test_no_ready_worker_is_unavailable_with_retry_after(stack):
    await stack.add(winfo("a", "http://127.0.0.1:9"))
    await stack.disc.set_state("a", WorkerState.DRAINING)
    await stack.app.state.pool.refresh()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.port}") as ch:
        call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                              request_serializer=triton_pb.ModelInferRequest.SerializeToString,
                              response_deserializer=triton_pb.ModelInferResponse.FromString)
        req = triton_pb.ModelInferRequest(model_name="m")
        req.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"x")
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await call(req)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "no worker is ready" in ei.value.details()
    md = dict(ei.value.trailing_metadata())
    assert md["retry-after"] == "2" and md["x-kvyard-error-type"] == "service_unavailable"


async def test_engine_errors_unary_and_stream(stack):
    with FakeEngine(fail_status=400) as eng:
        await stack.add(winfo("a", eng.url))
        with pytest.raises(InferenceServerException) as ei:
            await stack.client.infer("m", inputs())
        assert ei.value.status() == "StatusCode.INVALID_ARGUMENT" and ei.value.message() == "boom"
        got = await stream(stack.client, {"model_name": "m", "inputs": inputs(stream=True), "request_id": "e"})
        assert len(got) == 1 and got[0][1].message() == "boom"
    assert stack.inflight("a") == 0


async def test_stream_broken_mid_way_ends_with_error_message(stack):
    with FakeEngine(tokens=6, break_after=2) as eng:
        await stack.add(winfo("a", eng.url))
        got = await stream(stack.client, {"model_name": "m", "inputs": inputs(stream=True)})
        assert [r.as_numpy("text_output").tolist() for r, _ in got[:2]] == [[b"x"], [b"x"]]
        assert got[-1][0] is None and "engine stream failed" in got[-1][1].message()
    assert stack.inflight("a") == 0


async def test_client_cancel_aborts_the_engine_request(stack):
    with FakeEngine(tokens=400) as eng:
        await stack.add(winfo("a", eng.url))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.port}") as ch:
            call = ch.stream_stream(STREAM_RPC, request_serializer=triton_pb.ModelInferRequest.SerializeToString,
                                    response_deserializer=triton_pb.ModelStreamInferResponse.FromString)()
            req = triton_pb.ModelInferRequest(model_name="m", id="long")
            req.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"x")
            req.inputs.add(name="stream", datatype="BOOL", shape=[1]).contents.bool_contents.append(True)
            await call.write(req)
            for _ in range(3):
                assert not (await call.read()).error_message
            assert stack.inflight("a") == 1
            call.cancel()
        for _ in range(200):
            if eng.cancelled and stack.inflight("a") == 0:
                break
            await asyncio.sleep(0.02)
        assert eng.cancelled == 1 and stack.inflight("a") == 0


async def test_deadline_on_unary_releases_the_router(stack):
    with FakeEngine(delay_s=2.0) as eng:
        await stack.add(winfo("a", eng.url))
        with pytest.raises(InferenceServerException) as ei:
            await stack.client.infer("m", inputs(), client_timeout=0.3)
        assert ei.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        for _ in range(100):
            if stack.inflight("a") == 0:
                break
            await asyncio.sleep(0.02)
        assert stack.inflight("a") == 0


async def test_metrics_count_grpc_like_http(stack):
    with FakeEngine(tokens=3) as eng:
        await stack.add(winfo("a", eng.url))
        await stream(stack.client, {"model_name": "m", "inputs": inputs(stream=True)})
        with pytest.raises(InferenceServerException):
            await stack.client.infer("nope", inputs())
    reg = stack.app.state.metrics.registry
    assert reg.get_sample_value("kvyard_requests_total", {"model": "m", "endpoint": "generate", "status": "ok"}) == 1
    assert reg.get_sample_value("kvyard_time_to_first_token_seconds_count", {"model": "m"}) == 1
    assert reg.get_sample_value("kvyard_requests_total", {"model": "", "endpoint": "/inference.GRPCInferenceService/ModelInfer",
                                                         "status": "404"}) == 1


async def test_health_check_follows_readiness(stack):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        NOT, OK = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
        for name in ("", "inference.GRPCInferenceService"):
            assert (await health.Check(health_pb2.HealthCheckRequest(service=name))).status == NOT
        with FakeEngine() as eng:
            await stack.add(winfo("a", eng.url))
            for name in ("", "inference.GRPCInferenceService"):
                assert (await health.Check(health_pb2.HealthCheckRequest(service=name))).status == OK
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == OK
            await stack.disc.deregister("a")
            await stack.app.state.pool.refresh()
            assert (await asyncio.wait_for(watch.read(), 5)).status == NOT
            watch.cancel()


async def test_reflection_lists_and_describes_the_service(stack):
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.port}") as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        reqs = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="inference.GRPCInferenceService"),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.health.v1.Health")]
        answers = [a async for a in stub.ServerReflectionInfo(iter(reqs))]
    names = {s.name for s in answers[0].list_services_response.service}
    assert names == {"inference.GRPCInferenceService", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    fd = descriptor_pb2.FileDescriptorProto.FromString(answers[1].file_descriptor_response.file_descriptor_proto[0])
    assert fd.package == "inference"
    assert {m.name for m in fd.service[0].method} >= {"ServerLive", "ServerReady", "ModelReady", "ServerMetadata",
                                                      "ModelMetadata", "ModelInfer", "ModelStreamInfer"}
    assert answers[2].file_descriptor_response.file_descriptor_proto


async def test_port_in_use_fails_loudly(stack):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(GrpcStartError):
            await start_grpc_server(stack.app.state.grpc.health._servicer.service, stack.app.state.pool, s.getsockname()[1])
