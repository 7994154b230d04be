"""The frontend's LoRA adapters, session affinity, multimodal parts and key priorities, in process against
scriptable engines that speak vLLM's (or SGLang's) adapter API."""

from __future__ import annotations


import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from orchestrator.security import KeyFile, generate_key, save_key_file
from workers.discovery import InMemoryDiscovery
from workers.sim.backend import SIM_TOKENIZER_DIR
from workers.types import WorkerInfo

from orchestrator.testing.fake_engine import ThreadedEngine

BASE = "m"


class AdapterEngine(ThreadedEngine):
    """Completions that echo their body, and vLLM's (or SGLang's) load/unload routes; `refuse` fails every load."""

    def __init__(self, flavor: str = "vllm", refuse: bool = False, already: tuple[str, ...] = ()) -> None:
        self.flavor, self.refuse = flavor, refuse
        self.loaded: set[str] = set(already)
        self.calls: list[tuple[str, str]] = []  # (load|unload, name)
        self.bodies: list[dict] = []
        prefix = "/v1" if flavor == "vllm" else ""
        self._serve_routes([
            Route("/v1/completions", self._complete, methods=["POST"]),
            Route("/v1/chat/completions", self._complete, methods=["POST"]),
            Route(f"{prefix}/load_lora_adapter", self._load, methods=["POST"]),
            Route(f"{prefix}/unload_lora_adapter", self._unload, methods=["POST"]),
            Route("/health", lambda r: PlainTextResponse("")),
            Route("/metrics", lambda r: PlainTextResponse("vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n")),
        ])

    async def _load(self, request: Request) -> Response:
        body = await request.json()
        self.calls.append(("load", body["lora_name"]))
        if self.refuse:
            return JSONResponse({"error": {"message": f"No adapter found for {body['lora_path']}", "type": "NotFoundError", "code": 404}},
                                status_code=404)
        if body["lora_name"] in self.loaded:
            return JSONResponse({"error": {"message": f"The lora adapter '{body['lora_name']}' has already been loaded.",
                                           "type": "InvalidUserInput", "code": 400}}, status_code=400)
        self.loaded.add(body["lora_name"])
        return Response("Success", status_code=200)

    async def _unload(self, request: Request) -> Response:
        name = (await request.json())["lora_name"]
        self.calls.append(("unload", name))
        self.loaded.discard(name)
        return Response("Success", status_code=200)

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        name = body.get("lora_path") or body["model"]
        if name != BASE and name not in self.loaded:
            return JSONResponse({"error": {"message": f"The model `{name}` does not exist.", "type": "NotFoundError", "code": 404}},
                                status_code=404)
        return JSONResponse({"id": "c", "object": "text_completion", "model": body["model"], "choices": [{"index": 0, "text": "x"}],
                             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})


def winfo(wid: str, url: str, backend: str = "vllm") -> WorkerInfo:
    return WorkerInfo(worker_id=wid, model=BASE, backend=backend, url=url, block_size=16, max_model_len=4096, tokenizer=str(SIM_TOKENIZER_DIR))


LORA = {"adapters": [{"name": "ad-a", "path": "/a", "base_model": BASE}, {"name": "ad-b", "path": "/b", "base_model": BASE}],
        "max_per_worker": 1, "failure_backoff_s": 60}


async def stack(cfg: FrontendConfig, engines: list[AdapterEngine], backend: str = "vllm"):
    disc = InMemoryDiscovery()
    app = create_app(cfg, disc)
    async with app.router.lifespan_context(app):
        for i, e in enumerate(engines):
            await disc.register(winfo(f"w{i}", e.url, backend), ttl_s=60)
        await app.state.pool.refresh()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            yield app, client


def complete(model: str, **extra) -> dict:
    return {"model": model, "prompt": "the same prompt for every adapter, long enough for two blocks of sixteen tokens each", "max_tokens": 1, **extra}


async def test_adapter_loads_on_first_use_then_its_holder_serves_it():
    with AdapterEngine() as e0, AdapterEngine() as e1:
        async for app, client in stack(FrontendConfig(lora=LORA, refresh_interval_s=60), [e0, e1]):
            r = await client.post("/v1/completions", json=complete("ad-a"))
            assert r.status_code == 200, r.text
            holder = r.headers["x-kvyard-worker"]
            eng = {"w0": e0, "w1": e1}[holder]
            assert eng.calls == [("load", "ad-a")] and eng.bodies[-1]["model"] == "ad-a"
            for _ in range(4):  # the router sends the adapter back to its holder; nothing else loads it
                r = await client.post("/v1/completions", json=complete("ad-a"))
                assert r.headers["x-kvyard-worker"] == holder
            assert e0.calls + e1.calls == [("load", "ad-a")]
            cluster = (await client.get("/api/cluster")).json()
            assert {w["worker_id"]: w["adapters"] for w in cluster["workers"]}[holder] == ["ad-a"]
            assert cluster["lora"]["loads"] == {"loaded": 1}
            models = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
            assert models["ad-a"]["parent"] == BASE and models["ad-a"]["root"] == "/a" and models[BASE]["parent"] is None


async def test_the_per_worker_cap_unloads_the_least_recently_used_idle_adapter():
    with AdapterEngine() as e0:
        async for app, client in stack(FrontendConfig(lora=LORA, refresh_interval_s=60), [e0]):
            for name in ("ad-a", "ad-b", "ad-a"):
                assert (await client.post("/v1/completions", json=complete(name))).status_code == 200
            assert e0.calls == [("load", "ad-a"), ("load", "ad-b"), ("unload", "ad-a"), ("load", "ad-a"), ("unload", "ad-b")]


async def test_unknown_adapter_is_a_404_in_openai_shape():
    with AdapterEngine() as e0:
        async for app, client in stack(FrontendConfig(lora=LORA, refresh_interval_s=60), [e0]):
            r = await client.post("/v1/completions", json=complete("ad-zzz"))
            assert r.status_code == 404
            assert r.json()["error"] == {"message": "The model `ad-zzz` does not exist.", "type": "not_found_error", "param": "model",
                                         "code": "model_not_found"}


async def test_a_failed_load_moves_on_and_that_worker_is_not_asked_again_for_a_while():
    with AdapterEngine(refuse=True) as bad, AdapterEngine() as good:
        async for app, client in stack(FrontendConfig(lora=LORA, refresh_interval_s=60, router={"policy": "round-robin"}), [bad, good]):
            for _ in range(3):
                r = await client.post("/v1/completions", json=complete("ad-a"))
                assert r.status_code == 200 and r.headers["x-kvyard-worker"] == "w1"
            assert bad.calls == [("load", "ad-a")]  # round-robin ranked w0 first once; then it is skipped in its backoff
            failing = (await client.get("/api/cluster")).json()["lora"]["failing"]
            assert [f["worker_id"] for f in failing] == ["w0"] and "No adapter found" in failing[0]["error"]


async def test_no_worker_can_load_it_is_a_clear_503():
    with AdapterEngine(refuse=True) as bad:
        async for app, client in stack(FrontendConfig(lora=LORA, refresh_interval_s=60), [bad]):
            r = await client.post("/v1/completions", json=complete("ad-b"))
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
            err = r.json()["error"]
            assert err["code"] == "adapter_load_failed" and "ad-b" in err["message"] and "No adapter found for /b" in err["message"]
            r = await client.post("/v1/completions", json=complete("ad-b"))
            assert r.status_code == 503 and bad.calls == [("load", "ad-b")]  # not retried within the backoff
            assert app.state.router.loads.load("w0").inflight_requests == 0  # nothing left booked


async def test_an_adapter_the_engine_already_holds_counts_as_loaded():
    with AdapterEngine(already=("ad-a",)) as e0:
        async for app, client in stack(FrontendConfig(lora=LORA, refresh_interval_s=60), [e0]):
            assert (await client.post("/v1/completions", json=complete("ad-a"))).status_code == 200
            assert app.state.service.lora.loads["already_loaded"] == 1


async def test_sglang_engines_get_the_adapter_as_lora_path():
    with AdapterEngine(flavor="sglang") as e0:
        async for app, client in stack(FrontendConfig(lora=LORA, refresh_interval_s=60), [e0], backend="sglang"):
            r = await client.post("/v1/completions", json=complete("ad-b"))
            assert r.status_code == 200, r.text
            assert e0.bodies[-1]["model"] == BASE and e0.bodies[-1]["lora_path"] == "ad-b"


async def test_a_session_sticks_to_its_worker_and_a_bad_session_id_is_a_400():
    with AdapterEngine() as e0, AdapterEngine() as e1:
        async for app, client in stack(FrontendConfig(refresh_interval_s=60, router={"policy": "round-robin"}), [e0, e1]):
            seen = {(await client.post("/v1/completions", json=complete(BASE), headers={"x-session-id": "conv-1"})).headers["x-kvyard-worker"]
                    for _ in range(5)}
            assert len(seen) == 1  # round-robin alone alternates
            cluster = (await client.get("/api/cluster")).json()
            assert cluster["sessions"]["pinned"] == 1 and sum(w["sessions_pinned"] for w in cluster["workers"]) == 1
            r = await client.post("/v1/completions", json=complete(BASE), headers={"x-session-id": "x" * 300})
            assert r.status_code == 400 and r.json()["error"]["param"] == "x-session-id"


async def test_images_get_uuids_for_vllm_and_bad_parts_are_400():
    with AdapterEngine() as e0:
        async for app, client in stack(FrontendConfig(refresh_interval_s=60), [e0]):
            img = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
            body = {"model": BASE, "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it"}, img]}]}
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            sent = e0.bodies[-1]["messages"][0]["content"][1]
            assert len(sent["uuid"]) == 64
            body["messages"][0]["content"][1] = {"type": "file", "file": {"file_id": "f"}}
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.1.type"
            assert len(e0.bodies) == 1  # the bad one never reached the engine


async def test_a_keys_priority_is_passed_to_the_engine_when_asked(tmp_path):
    keys, records = {}, []
    for name, cls in (("vip", "high"), ("batch", "low"), ("plain", "normal")):
        key, rec = generate_key(name, priority=cls, weight=2.0)
        keys[name] = key
        records.append(rec)
    save_key_file(tmp_path / "k.yaml", KeyFile(keys=records))
    cfg = FrontendConfig(refresh_interval_s=60, security={"api_keys_file": tmp_path / "k.yaml"}, fair_share={"engine_priority": True})
    with AdapterEngine() as e0:
        async for app, client in stack(cfg, [e0]):
            for name, want in (("vip", -1), ("batch", 1), ("plain", 0)):
                r = await client.post("/v1/completions", json=complete(BASE), headers={"authorization": f"Bearer {keys[name]}"})
                assert r.status_code == 200 and e0.bodies[-1]["priority"] == want


async def test_config_refuses_bad_feature_settings():
    from pydantic import ValidationError

    for bad in ({"lora": {"adapters": [{"name": "a", "path": "/a", "base_model": "m"}] * 2}},
                {"lora": {"adapters": [{"name": "m", "path": "/a", "base_model": "m"}]}},
                {"lora": {"max_per_worker": 0}}, {"affinity": {"ttl_s": 0}}, {"affinity": {"unknown": 1}},
                {"fair_share": {"enabled": "maybe"}}, {"multimodal": {"tokens_per_image": 0}}):
        with pytest.raises(ValidationError):
            FrontendConfig(**bad)
