"""OpenTelemetry tracing in the frontend, against an in-memory exporter: the span tree of a request (admission,
tokenize, route decision, each engine attempt, migration), its attributes, the client's and the engine's
traceparent, and tracing off by default."""

from __future__ import annotations

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from orchestrator.testing import FakeEngine, FaultEngine, free_port, winfo
from orchestrator.testing.sim_thread import ThreadedSim
from orchestrator.tracing import Tracing, TracingConfig, TracingMiddleware
from workers.discovery import InMemoryDiscovery

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture
async def traced():
    """(client, discovery, exporter) on a frontend tracing into memory."""
    exporter = InMemorySpanExporter()
    disc = InMemoryDiscovery()
    cfg = FrontendConfig(refresh_interval_s=0.05, grpc_port=0, router={"policy": "round-robin"},
                         resilience={"retry_backoff_base_s": 0.001, "retry_backoff_max_s": 0.002})
    app = create_app(cfg, disc, tracing=Tracing(TracingConfig(enabled=True), exporter=exporter))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            client.refresh = app.state.pool.refresh
            yield client, disc, exporter


async def add(disc, client, *infos):
    for i in infos:
        await disc.register(i, ttl_s=60)
    await client.refresh()


def tree(exporter) -> tuple[object, dict[str, list]]:
    """(the request's SERVER span, its children by name)."""
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name.startswith("POST ")]
    assert len(roots) == 1, [s.name for s in spans]
    root = roots[0]
    kids: dict[str, list] = {}
    for s in spans:
        assert s.context.trace_id == root.context.trace_id  # one trace
        if s.parent is not None and s.parent.span_id == root.context.span_id:
            kids.setdefault(s.name, []).append(s)
    return root, kids


async def test_span_tree_of_a_request_and_traceparent_both_ways(traced):
    client, disc, exporter = traced
    with FakeEngine(tokens=3) as eng:
        await add(disc, client, winfo("a", eng.url))
        r = await client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hello"}],
                                                             "max_tokens": 3},
                              headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
        assert r.status_code == 200
    root, kids = tree(exporter)
    # the client's trace is joined
    assert f"{root.context.trace_id:032x}" == CLIENT_TRACE and f"{root.parent.span_id:016x}" == CLIENT_SPAN
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["kvyard.request_id"] == r.headers["x-request-id"] and root.attributes["kvyard.model"] == "m"
    assert set(kids) == {"kvyard.tokenize", "kvyard.admission", "kvyard.route", "kvyard.engine_attempt"}
    route = kids["kvyard.route"][0].attributes
    assert route["kvyard.policy"] == "round-robin" and route["kvyard.worker"] == "a" and route["kvyard.candidates"] == 1
    assert "kvyard.overlap_blocks" in route and "kvyard.cost" in route
    attempt = kids["kvyard.engine_attempt"][0]
    assert attempt.attributes["kvyard.worker"] == "a" and attempt.attributes["kvyard.phase"] == "aggregated"
    assert attempt.attributes["http.response.status_code"] == 200
    # the engine got the attempt span as its parent: its own spans join the trace under it
    sent = eng.requests[0]["headers"]["traceparent"]
    assert sent == f"00-{CLIENT_TRACE}-{attempt.context.span_id:016x}-01"
    order = sorted(kids, key=lambda n: kids[n][0].start_time)
    assert order == ["kvyard.tokenize", "kvyard.admission", "kvyard.route", "kvyard.engine_attempt"]


async def test_failover_gives_one_attempt_span_each(traced):
    client, disc, exporter = traced
    with FakeEngine() as eng:
        dead = f"http://127.0.0.1:{free_port()}"
        await add(disc, client, winfo("a-dead", dead), winfo("b-live", eng.url))
        for _ in range(2):  # round-robin puts the dead one first once
            exporter.clear()
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
            _, kids = tree(exporter)
            if len(kids["kvyard.engine_attempt"]) == 2:
                break
        attempts = sorted(kids["kvyard.engine_attempt"], key=lambda s: s.attributes["kvyard.attempt"])
        assert [a.attributes["kvyard.worker"] for a in attempts] == ["a-dead", "b-live"]
        assert not attempts[0].status.is_ok and attempts[0].status.description
        assert attempts[1].attributes["http.response.status_code"] == 200


async def test_stream_span_covers_the_body_and_migration_is_a_span(traced):
    client, disc, exporter = traced
    plan = [{"break_after": 3}]
    a, b = FaultEngine("a", plan=plan), FaultEngine("b", plan=plan)
    with a, b:
        await add(disc, client, winfo("a", a.url), winfo("b", b.url))
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "hello world", "max_tokens": 8, "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    root, kids = tree(exporter)
    mig = kids["kvyard.migration"][0]
    assert mig.attributes["kvyard.migration"] == 1 and mig.attributes["kvyard.from_worker"] in ("a", "b")
    cont = [s for s in exporter.get_finished_spans() if s.parent is not None and s.parent.span_id == mig.context.span_id]
    assert [s.name for s in cont] == ["kvyard.engine_attempt"]  # the continuation's POST, under the migration
    assert cont[0].attributes["kvyard.worker"] != mig.attributes["kvyard.from_worker"]
    assert root.end_time >= mig.end_time  # the request's span ends with its stream


async def test_forwarded_endpoints_are_traced(traced):
    client, disc, exporter = traced
    with ThreadedSim("--runner", "pooling", model="emb") as sim:
        await add(disc, client, sim.info("e1"))
        r = await client.post("/v1/embeddings", json={"model": "emb", "input": "hi"})
        assert r.status_code == 200
    root, kids = tree(exporter)
    assert root.name == "POST /v1/embeddings" and root.attributes["kvyard.model"] == "emb"
    assert kids["kvyard.route"][0].attributes["kvyard.worker"] == "e1"
    assert kids["kvyard.engine_attempt"][0].attributes["http.response.status_code"] == 200


async def test_unsampled_client_trace_records_nothing(traced):
    client, disc, exporter = traced
    with FakeEngine() as eng:
        await add(disc, client, winfo("a", eng.url))
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2},
                              headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"})
        assert r.status_code == 200
        assert exporter.get_finished_spans() == ()
        assert "traceparent" not in eng.requests[0]["headers"]


async def test_tracing_is_off_by_default():
    cfg = FrontendConfig(grpc_port=0)
    assert cfg.telemetry.tracing.enabled is False
    app = create_app(cfg, InMemoryDiscovery())
    assert app.state.service.tracing.enabled is False
    assert not any(m.cls is TracingMiddleware for m in app.user_middleware)
    off = Tracing.off()
    with off.span("x") as s:
        assert s is None
    assert off.attempt(object(), 0, {"a": "b"}) == ({"a": "b"}, None)


async def test_disaggregated_request_has_prefill_and_decode_attempts():
    from orchestrator.testing import FakePDEngine, HandoffBook
    from workers.sim.backend import SIM_TOKENIZER_DIR
    from workers.types import WorkerInfo, WorkerRole

    exporter = InMemorySpanExporter()
    disc = InMemoryDiscovery()
    app = create_app(FrontendConfig(refresh_interval_s=60, grpc_port=0), disc, tracing=Tracing(TracingConfig(enabled=True), exporter=exporter))
    book = HandoffBook()
    with FakePDEngine("vllm", "prefill", book) as p, FakePDEngine("vllm", "decode", book, tokens=3) as d:
        for wid, url, role in (("p", p.url, "prefill"), ("d", d.url, "decode")):
            await disc.register(WorkerInfo(worker_id=wid, model="m", backend="sim", role=WorkerRole(role), url=url, block_size=16,
                                           max_model_len=4096, tokenizer=str(SIM_TOKENIZER_DIR), pd_protocol="vllm"), ttl_s=60)
        async with app.router.lifespan_context(app):
            await app.state.pool.refresh()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=20) as client:
                r = await client.post("/v1/completions", json={"model": "m", "prompt": "word " * 3000, "max_tokens": 3})
                assert r.status_code == 200, r.text
        _, kids = tree(exporter)
        phases = {s.attributes["kvyard.phase"]: s for s in kids["kvyard.engine_attempt"]}
        assert set(phases) == {"prefill", "decode"}
        assert phases["prefill"].attributes["kvyard.worker"] == "p" and phases["decode"].attributes["kvyard.worker"] == "d"
        assert phases["prefill"].end_time <= phases["decode"].start_time
        # each engine got its own attempt's span as parent
        assert p.requests[0]["headers"]["traceparent"].split("-")[2] == f"{phases['prefill'].context.span_id:016x}"
        assert d.requests[0]["headers"]["traceparent"].split("-")[2] == f"{phases['decode'].context.span_id:016x}"
