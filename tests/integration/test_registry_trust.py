"""Redis as a trust boundary (issue #19, classes 4 and 10), against real Redis servers.

    validation   an entry with block_size 0, garbage, a file:// URL or another worker's id is skipped with one log line
                 (requests keep working); a live worker whose entry was overwritten with garbage heals at its next renewal
    signing      with a registry secret, unsigned, wrongly signed and replayed (expired) entries are ignored, and so are
                 unsigned tokenizer files; a worker holding the secret is listed
    ACL user     a frontend (discovery, telemetry, targets, rate limits) and a worker run on a Redis user allowed only
                 the cluster's key prefix and the command categories docs/security.md lists: Redis denies nothing
    rediss://    discovery over TLS, verified against the CA; the same port without TLS fails
The ACL and TLS cases run a private redis-server each (never the shared one's settings).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import time
import uuid

import httpx
import pytest
import redis.asyncio as aioredis

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from orchestrator.security import KeyFile, generate_key, save_key_file
from orchestrator.testing import FakeEngine, free_port
from tests.unit.orchestrator.test_tls import make_certs
from workers.discovery import DiscoveryError, RedisDiscovery
from workers.registry import get_backend
from workers.signing import sign_entry
from workers.sim.backend import SIM_TOKENIZER_DIR
from workers.types import EngineLaunchConfig, WorkerInfo, WorkerState
from workers.worker import WorkerOptions, WorkerSupervisor

SECRET = "registry-secret-for-the-tests-0123"


def winfo(wid: str, url: str = "http://127.0.0.1:9", **kw) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, model="m", backend="sim", url=url, block_size=16, max_model_len=4096,
                      tokenizer=str(SIM_TOKENIZER_DIR), **kw)


@pytest.fixture
async def raw(redis_url):
    prefix = f"kvyard-trust-{uuid.uuid4().hex[:8]}"
    r = aioredis.from_url(redis_url)
    yield r, prefix
    keys = [k async for k in r.scan_iter(match=f"{prefix}:*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


async def plant(r, prefix: str, wid: str, value: str | bytes, ttl_s: float = 30) -> None:
    """What an attacker (or a bug) with write access to Redis does: any value under a worker's key."""
    await r.set(f"{prefix}:worker:{wid}", value, px=int(ttl_s * 1000))
    await r.sadd(f"{prefix}:workers", wid)


# ---- (4) validation: bad entries skipped with one log line, requests unaffected ------------------------------------

async def test_bad_entries_are_skipped_with_one_log_line(raw, redis_url, caplog):
    r, prefix = raw
    d = RedisDiscovery(redis_url, prefix=prefix)
    try:
        with FakeEngine() as eng:
            await d.register(winfo("good", eng.url), 30)
            bad = {"zero-blocks": winfo("zero-blocks").model_dump(mode="json") | {"block_size": 0},
                   "file-url": winfo("file-url").model_dump(mode="json") | {"url": "file:///etc/passwd"},
                   "ftp-url": winfo("ftp-url").model_dump(mode="json") | {"url": "ftp://10.6.6.6/x"},
                   "other-id": winfo("someone-else").model_dump(mode="json"),
                   "negative-ctx": winfo("negative-ctx").model_dump(mode="json") | {"max_model_len": -5}}
            for wid, doc in bad.items():
                await plant(r, prefix, wid, json.dumps(doc))
            await plant(r, prefix, "garbage", b"\x00\xffnot json{")
            caplog.set_level(logging.WARNING, "kvyard.discovery")
            for _ in range(3):
                assert [w.worker_id for w in await d.list_workers()] == ["good"]
            skipped = [rec for rec in caplog.records if "skipped" in rec.getMessage()]
            assert sorted(rec.getMessage().split("'")[1] for rec in skipped) == sorted([*bad, "garbage"])  # once each
            assert {m.decode() for m in await r.smembers(f"{prefix}:workers")} >= set(bad)  # not pruned: renewals heal them

            app = create_app(FrontendConfig(redis_url=redis_url, discovery_prefix=prefix, refresh_interval_s=60, grpc_port=0), None)
            async with app.router.lifespan_context(app):
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
                    for _ in range(4):
                        res = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
                        assert res.status_code == 200, res.text
    finally:
        await d.close()


async def test_an_overwritten_entry_heals_at_the_next_renewal(raw, redis_url):
    r, prefix = raw
    d = RedisDiscovery(redis_url, prefix=prefix)
    cfg = EngineLaunchConfig(model="h200-llama3.1-8b", served_model_name="m", port=free_port())
    sup = WorkerSupervisor(get_backend("sim"), cfg, d, WorkerOptions(worker_id="w1", lease_ttl_s=30))
    try:
        sup.info = sup.build_info()
        await d.register(sup.info, 30)
        await plant(r, prefix, "w1", "garbage written over a live worker")
        assert await d.list_workers() == []
        await sup._renew()  # what the worker's run loop does every lease_ttl/3
        (got,) = await d.list_workers()
        assert got.worker_id == "w1" and got.url == sup.info.url
    finally:
        await d.close()


# ---- (10) signed registry entries --------------------------------------------------------------------------------

async def test_only_signed_entries_are_trusted(raw, redis_url, caplog):
    r, prefix = raw
    reader = RedisDiscovery(redis_url, prefix=prefix, secret=SECRET)
    writer = RedisDiscovery(redis_url, prefix=prefix, secret=SECRET)
    try:
        await writer.register(winfo("honest"), 30)
        forged = winfo("evil", url="http://10.6.6.6:8000").model_dump(mode="json")
        await plant(r, prefix, "evil", json.dumps(forged))  # unsigned
        await plant(r, prefix, "evil2", sign_entry(winfo("evil2").model_dump(mode="json"), b"another-secret-0123456789", 30))
        stale = sign_entry(winfo("old").model_dump(mode="json"), SECRET.encode(), 30, now=time.time() - 3600)
        await plant(r, prefix, "old", stale)  # a signed entry replayed long after it was written
        tampered = json.loads(sign_entry(winfo("tamper").model_dump(mode="json"), SECRET.encode(), 30))
        tampered["url"] = "http://10.6.6.6:8000"
        await plant(r, prefix, "tamper", json.dumps(tampered))
        caplog.set_level(logging.WARNING, "kvyard.discovery")
        assert [w.worker_id for w in await reader.list_workers()] == ["honest"]
        why = " ".join(rec.getMessage() for rec in caplog.records)
        assert "unsigned" in why and "bad signature" in why and "expired" in why
        # a reader without the secret ignores the signature fields (signing can be rolled out writers first)
        plain = RedisDiscovery(redis_url, prefix=prefix)
        assert "honest" in [w.worker_id for w in await plain.list_workers()]
        await plain.close()
        # tokenizer files: published by a writer with the secret, or ignored
        await writer.publish_files("m", {"tokenizer.json": b"{}"})
        assert await reader.fetch_files("m") == {"tokenizer.json": b"{}"}
        await RedisDiscovery(redis_url, prefix=prefix).publish_files("m", {"tokenizer.json": b'{"evil": 1}'})
        assert await reader.fetch_files("m") == {}
    finally:
        await reader.close()
        await writer.close()


# ---- (10) an ACL user and TLS ------------------------------------------------------------------------------------

def _redis_server(*args: str) -> subprocess.Popen:
    exe = shutil.which("redis-server")
    assert exe, "redis-server is not installed"
    return subprocess.Popen([exe, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


async def _wait_redis(url: str, **kw) -> None:
    deadline = time.monotonic() + 10
    while True:
        r = aioredis.from_url(url, **kw)
        try:
            if await r.ping():
                return
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
        finally:
            await r.aclose()


# The ACL of docs/security.md for a cluster whose discovery prefix is "kvyard".
KVYARD_ACL = ["on", ">kvyard-user-password", "~kvyard:*", "resetchannels", "-@all", "+@read", "+@write", "+@scripting",
              "+@transaction", "+@connection", "+time", "-@dangerous"]


async def test_a_least_privilege_acl_user_is_enough(tmp_path):
    port = free_port()
    proc = _redis_server("--port", str(port), "--requirepass", "admin-password")
    admin_url = f"redis://:admin-password@127.0.0.1:{port}/0"
    url = f"redis://kvyard:kvyard-user-password@127.0.0.1:{port}/0"
    try:
        await _wait_redis(admin_url)
        admin = aioredis.from_url(admin_url)
        await admin.execute_command("ACL", "SETUSER", "kvyard", *KVYARD_ACL)
        key, rec = generate_key("acl", rpm=100, tpm=100000)
        save_key_file(tmp_path / "keys.yaml", KeyFile(keys=[rec]))
        worker_disc = RedisDiscovery(url, prefix="kvyard")
        with FakeEngine() as eng:
            await worker_disc.register(winfo("w", eng.url), 30)
            await worker_disc.publish_files("m", {"tokenizer.json": (SIM_TOKENIZER_DIR / "tokenizer.json").read_bytes()})
            assert await worker_disc.renew("w", 30, info=winfo("w", eng.url))
            cfg = FrontendConfig(redis_url=url, refresh_interval_s=0.2, grpc_port=0, telemetry={"interval_s": 0.2},
                                 security={"admin_token": "acl-admin-token-0123", "api_keys_file": tmp_path / "keys.yaml"})
            app = create_app(cfg, None)
            async with app.router.lifespan_context(app):
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=30) as c:
                    h = {"authorization": f"Bearer {key}"}
                    for _ in range(3):
                        res = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}, headers=h)
                        assert res.status_code == 200, res.text
                    adm = {"authorization": "Bearer acl-admin-token-0123"}
                    body = {"pools": [{"model": "m", "role": "both", "min_replicas": 1, "max_replicas": 2}]}
                    assert (await c.put("/admin/targets", json=body, headers=adm)).status_code == 200
                    await asyncio.sleep(0.5)  # a telemetry flush
                    assert (await c.get("/api/pools", headers=adm)).status_code == 200
            await worker_disc.set_state("w", WorkerState.DRAINING)
            await worker_disc.deregister("w")
        await worker_disc.close()
        denied = await admin.execute_command("ACL", "LOG")
        assert denied == [], denied  # every command and key kvyard used was within the ACL
        await admin.aclose()
        with pytest.raises(DiscoveryError):  # and a wrong password is a clean DiscoveryError
            bad = RedisDiscovery(f"redis://kvyard:wrong@127.0.0.1:{port}/0", prefix="kvyard")
            try:
                await bad.list_workers()
            finally:
                await bad.close()
    finally:
        proc.terminate()
        proc.wait(10)


async def test_discovery_over_tls(tmp_path):
    certs = make_certs(tmp_path)
    port = free_port()
    proc = _redis_server("--port", "0", "--tls-port", str(port), "--tls-cert-file", str(certs["cert"]),
                         "--tls-key-file", str(certs["key"]), "--tls-ca-cert-file", str(certs["ca"]), "--tls-auth-clients", "no")
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs['ca']}"
    try:
        await _wait_redis(url)
        d = RedisDiscovery(url, prefix="kvyard-tls")
        await d.register(winfo("tls-worker"), 30)
        assert [w.worker_id for w in await d.list_workers()] == ["tls-worker"]
        await d.close()
        plain = RedisDiscovery(f"redis://127.0.0.1:{port}/0", prefix="kvyard-tls", timeout_s=1.0)
        with pytest.raises(DiscoveryError):
            await plain.list_workers()
        await plain.close()
        unverified = RedisDiscovery(f"rediss://127.0.0.1:{port}/0", prefix="kvyard-tls", timeout_s=1.0)  # system CAs only
        with pytest.raises(DiscoveryError):
            await unverified.list_workers()
        await unverified.close()
    finally:
        proc.terminate()
        proc.wait(10)
