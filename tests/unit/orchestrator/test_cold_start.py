"""A frontend that knows no worker yet (just started, or its registry emptied by a Redis restart while the
workers re-register) answers 503 + Retry-After, retryable, not a 404 that says the model does not exist;
once any worker is known, an unknown model is a 404 again."""

from __future__ import annotations

import httpx

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from workers.discovery import DiscoveryError, InMemoryDiscovery
from workers.sim.backend import SIM_TOKENIZER_DIR
from workers.types import WorkerInfo

from orchestrator.testing import FakeEngine


class Unreachable(InMemoryDiscovery):
    down = False

    async def list_workers(self):
        if self.down:
            raise DiscoveryError("redis unavailable: connection refused")
        return await super().list_workers()


async def test_no_workers_known_is_503_then_404_for_a_wrong_name():
    disc = Unreachable()
    app = create_app(FrontendConfig(refresh_interval_s=60, grpc_port=0, resilience={"retry_after_s": 2}), disc)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvyard") as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] == "2" and r.json()["error"]["message"]
            with FakeEngine() as eng:
                await disc.register(WorkerInfo(worker_id="a", model="m", backend="sim", url=eng.url, block_size=16,
                                               tokenizer=str(SIM_TOKENIZER_DIR)), ttl_s=60)
                await app.state.pool.refresh()
                assert (await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})).status_code == 200
                r = await c.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
                assert r.status_code == 404
                disc.down = True  # cut off from discovery: the last view serves, a name outside it is not declared missing
                await app.state.pool.refresh()
                assert (await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})).status_code == 200
                assert (await c.post("/v1/completions", json={"model": "nope", "prompt": "hi"})).status_code == 503
