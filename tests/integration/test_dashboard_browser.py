"""The operator dashboard in a real browser: Playwright drives Debian's Chromium against `kvyard up`.

A stack of 2 sim workers (Redis for discovery, telemetry and targets, under a private key prefix)
serves some load, with an admin token set: every read (/api/pools, /api/cluster) and write needs it,
the page takes it from the URL fragment (#token=..., as `kvyard up` prints it) into sessionStorage
and sends it as a bearer token; the page must show the numbers telemetry holds (worker count, requests, TTFT/ITL
p90 as /api/pools computes them), refuse a bad target with the API's message, save a good one (the
version increments and GET /admin/targets returns it), and the planner's next tick, reading the
same Redis targets, must decide against the new version and have its reason shown on the page.
Screenshots go to the test's temporary folder; with KVYARD_UPDATE_SCREENSHOTS=1 they replace the ones kept in
benchmarks/results/dashboard/ (so `make test` leaves the tree clean).

Needs /usr/bin/chromium and the playwright package (scripts/install_browser.sh); FAILS without them.
`playwright install` is never used.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from orchestrator.testing import free_port, free_port_run

pytestmark = [pytest.mark.slow, pytest.mark.redis]

REPO = Path(__file__).resolve().parents[2]
KEPT_SHOTS = REPO / "benchmarks" / "results" / "dashboard"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
REDIS_URL = os.environ.get("KVYARD_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
TOKEN = "dash-" + uuid.uuid4().hex
N_REQUESTS = 48


def _browser_or_fail():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run scripts/install_browser.sh")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright package is missing: run scripts/install_browser.sh")
    return sync_playwright


@pytest.fixture
def stack(tmp_path):
    sync_playwright = _browser_or_fail()
    port, base = free_port(), free_port_run(8)
    prefix = f"kvyard-dash-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "KVYARD_ADMIN_TOKEN": TOKEN}
    log = open(tmp_path / "up.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "up", "--workers", "2", "--speedup", "4", "--grpc-port", "0",
                             "--port", str(port), "--base-port", str(base), "--redis-url", REDIS_URL, "--discovery-prefix", prefix],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=60) as client:
            deadline = time.monotonic() + 90
            while True:
                try:
                    body = client.get(url + "/api/cluster", headers=_admin()).json()
                    if sum(w["state"] == "ready" for w in body["workers"]) == 2:
                        break
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("kvyard up did not start:\n" + (tmp_path / "up.log").read_text()[-3000:])
                time.sleep(0.3)
            yield client, url, prefix, sync_playwright
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
        asyncio.run(_drop_keys(prefix))


async def _drop_keys(prefix: str) -> None:
    import redis.asyncio as aioredis

    r = aioredis.from_url(REDIS_URL)
    try:
        keys = [k async for k in r.scan_iter(match=f"{prefix}:*", count=500)]
        if keys:
            await r.delete(*keys)
    finally:
        await r.aclose()


def _admin(token: str = TOKEN) -> dict:
    return {"authorization": f"Bearer {token}"}


def _drive_load(url: str, model: str) -> None:
    doc = " ".join(f"clause {j} of the shared operating manual." for j in range(120))

    def one(i: int) -> int:
        body = {"model": model, "prompt": f"{doc} Question {i}: what does clause {i % 7} say?", "max_tokens": 24, "stream": True}
        session = {"x-session-id": f"conv-{i % 3}"}  # three conversations: the dashboard shows them pinned
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body, headers=session) as r:
            text = "".join(r.iter_text())  # streamed, so the frontend measures TTFT and ITL
            return r.status_code if "[DONE]" in text else -1

    with ThreadPoolExecutor(8) as ex:
        codes = list(ex.map(one, range(N_REQUESTS)))
    assert codes == [200] * N_REQUESTS, codes


def _planner_tick(prefix: str, pool_key, replicas: int):
    """One planner tick on the stack's Redis stores (as `kvyard planner --advisory` would run it)."""
    from planner.config import PlannerConfig
    from planner.connectors import VirtualConnector
    from planner.service import build_planner
    from planner.telemetry.redis_store import RedisTelemetryStore
    from planner.telemetry.schema import TelemetrySchema
    from planner.telemetry.targets import RedisTargetsStore

    async def run():
        telemetry = RedisTelemetryStore(REDIS_URL, TelemetrySchema(prefix=prefix))
        targets = RedisTargetsStore(REDIS_URL, prefix=prefix)
        loop = build_planner(PlannerConfig(mode="sla", predictor="constant", advisory=True, interval_s=60),
                             telemetry, targets, VirtualConnector({pool_key: replicas}))
        try:
            return await loop.tick()
        finally:
            await telemetry.close()
            await targets.close()

    with ThreadPoolExecutor(1) as ex:  # its own thread: Playwright's sync API holds this thread's event loop
        return ex.submit(asyncio.run, run()).result()


def test_dashboard_shows_telemetry_and_edits_targets(stack, tmp_path):
    shots = KEPT_SHOTS if os.environ.get("KVYARD_UPDATE_SCREENSHOTS") == "1" else tmp_path
    client, url, prefix, sync_playwright = stack
    from planner.telemetry.schema import PoolKey

    workers = client.get(url + "/api/cluster", headers=_admin()).json()["workers"]
    model, role = workers[0]["model"], workers[0]["role"]
    pid = f"{model}|{role}"
    pool_key = PoolKey(model, role)

    # with an admin token set, every admin surface needs it, reads included; the page itself is a static shell
    for path in ("/admin/targets", "/api/pools", "/api/cluster"):
        r = client.get(url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token", (path, r.text)
    assert client.get(url + "/api/pools", headers=_admin("dash-wrong")).status_code == 401
    shell = client.get(url + "/dashboard")
    assert shell.status_code == 200 and TOKEN not in shell.text
    r = client.put(url + "/admin/targets", headers=_admin(), json={
        "pools": [{"model": model, "role": role, "ttft_p90_ms": 800, "itl_p90_ms": 60, "min_replicas": 1, "max_replicas": 6}],
        "gpu_budget": 8})
    assert r.status_code == 200, r.text
    v1 = r.json()["version"]

    _drive_load(url, model)
    deadline = time.monotonic() + 45  # the frontend flushes telemetry about once a second (slower on a loaded box)
    last_kv = None
    while True:
        api = client.get(url + "/api/pools", headers=_admin()).json()
        pool = next((p for p in api["pools"] if p["model"] == model and p["role"] == role), None)
        # request records arrive with the next flush; the KV hit rate with the engine scrapes after that (the
        # engines' counters are diffed from the scrape each worker got when it joined, before it was routable).
        # Each worker is scraped on its own, so one scrape can carry part of the load's prefix-cache counts and
        # the next the rest (a CI run saw 90.7% on the page, 94.2% a moment later): wait until the hit rate holds
        # still across more than a scrape interval plus a flush.
        kv = pool["summary"]["kv_hit_rate"] if pool else None
        if pool and pool["summary"]["requests"] == N_REQUESTS and kv is not None and kv == last_kv:
            break
        last_kv = kv
        assert time.monotonic() < deadline, (pool, client.get(url + "/api/cluster", headers=_admin()).json())
        time.sleep(2.5)
    assert "dash-" not in str(api)  # no secrets in the read endpoint
    s = pool["summary"]
    assert s["ttft_p90_ms"] and s["itl_p90_ms"] and s["tokens_per_s"] > 0, s

    first = _planner_tick(prefix, pool_key, 2)
    assert first.targets_version == v1

    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            rate_before = next(p for p in client.get(url + "/api/pools", headers=_admin()).json()["pools"]
                               if p["model"] == model and p["role"] == role)["summary"]["request_rate"]
            page.goto(url + f"/dashboard?window=60#token={TOKEN}")  # a one-minute time axis: the load ran for seconds
            card = page.locator(f'.pool[data-pool="{pid}"]')
            card.wait_for(timeout=15_000)
            page.wait_for_function("document.getElementById('worker-count') !== null", timeout=10_000)
            # the token moved from the fragment to sessionStorage and left the address bar
            assert page.evaluate("location.hash") == "" and TOKEN not in page.url
            assert page.evaluate("sessionStorage.getItem('kvyard-admin-token')") == TOKEN

            # the numbers shown are telemetry's (as /api/pools computes them right now)
            assert page.locator("#worker-count").inner_text() == str(len(workers)) == "2"
            # sessions pinned (three conversations), and the admission queue per priority class
            cluster = client.get(url + "/api/cluster", headers=_admin()).json()
            assert page.locator("#sessions-pinned").inner_text() == str(cluster["sessions"]["pinned"]) == "3"
            assert sum(int(c.inner_text()) for c in page.locator("#rows tr td:nth-child(10)").all()) == 3
            assert page.locator("#queues tr").first.locator("td").first.inner_text() == model
            assert card.locator('[data-stat="replicas"]').inner_text() == "2"
            assert card.locator('[data-stat="requests"]').inner_text() == str(N_REQUESTS)
            now = client.get(url + "/api/pools", headers=_admin()).json()
            s = next(p for p in now["pools"] if p["model"] == model and p["role"] == role)["summary"]
            assert card.locator('[data-stat="ttft_p90_ms"]').inner_text() == f"{s['ttft_p90_ms']:.1f}"
            assert card.locator('[data-stat="itl_p90_ms"]').inner_text() == f"{s['itl_p90_ms']:.2f}"
            shown_kv = card.locator('[data-stat="kv_hit_rate"]').inner_text()
            assert shown_kv == f"{s['kv_hit_rate'] * 100:.1f}" == f"{last_kv * 100:.1f}", (shown_kv, last_kv, s)
            shown_rate = float(card.locator('[data-stat="request_rate"]').inner_text())
            # a rate is requests over the summary window, which grows by a bucket when a bucket boundary passes:
            # the page read it between these two API reads
            lo, hi = sorted((rate_before, s["request_rate"]))
            assert lo * 0.95 - 0.01 <= shown_rate <= hi * 1.05 + 0.01, (rate_before, shown_rate, s["request_rate"])
            assert "target 800" in card.inner_text()  # the TTFT target drawn against the series
            assert card.locator("svg .target").count() >= 2 and card.locator("svg path.line").count() == 6
            # the planner's decision and its reason
            decisions = page.locator("#decisions")
            assert first.pools[0].reason[:40] in decisions.inner_text()
            page.screenshot(path=str(shots / "dashboard-overview.png"), full_page=True)

            # a bad value: the API's validation message is shown and nothing is saved
            row = page.locator(f'#editor tr[data-pool="{pid}"]')
            page.fill("#token", TOKEN)
            row.locator('input[name="ttft_p90_ms"]').fill("-5")
            page.click("#save-targets")
            msg = page.locator("#targets-msg")
            page.wait_for_selector("#targets-msg.error", timeout=10_000)
            assert "ttft_p90_ms" in msg.inner_text() and "greater than 0" in msg.inner_text(), msg.inner_text()
            assert client.get(url + "/admin/targets", headers=_admin()).json()["version"] == v1

            # a wrong token is refused too
            page.fill("#token", "not-the-token")
            row.locator('input[name="ttft_p90_ms"]').fill("250")
            page.click("#save-targets")
            page.wait_for_function("document.getElementById('targets-msg').textContent.includes('401')", timeout=10_000)

            # a good value: saved as the next version
            page.fill("#token", TOKEN)
            row.locator('input[name="ttft_p90_ms"]').fill("250")
            row.locator('input[name="tokens_per_s"]').fill("40000")
            row.locator('input[name="max_replicas"]').fill("12")
            page.click("#save-targets")
            page.wait_for_selector("#targets-msg.ok", timeout=10_000)
            assert msg.inner_text() == f"saved: targets are now version {v1 + 1}"
            assert page.evaluate("sessionStorage.getItem('kvyard-admin-token')") == TOKEN
            got = client.get(url + "/admin/targets", headers=_admin()).json()
            assert got["version"] == v1 + 1
            pt = got["targets"]["pools"][0]
            assert (pt["ttft_p90_ms"], pt["tokens_per_s"], pt["itl_p90_ms"], pt["max_replicas"]) == (250, 40000, 60, 12)
            assert got["targets"]["gpu_budget"] == 8

            # the planner's next tick reads the new version and sizes for the new tokens/s target
            d = _planner_tick(prefix, pool_key, 2)
            assert d.targets_version == v1 + 1
            assert "tokens/s target 40000" in d.pools[0].reason and d.pools[0].desired > 2, d.pools[0].reason
            page.click("#reload-targets")
            page.wait_for_function("document.getElementById('decisions').textContent.includes('tokens/s target 40000')", timeout=10_000)
            assert "target 250" in card.inner_text()
            assert page.locator("#targets-version").inner_text() == f"version {v1 + 1}"
            page.screenshot(path=str(shots / "dashboard-after-edit.png"), full_page=True)
            assert not errors, errors
            # the 401s above were logged without the tokens they carried
            assert TOKEN not in (tmp_path / "up.log").read_text() and "dash-wrong" not in (tmp_path / "up.log").read_text()
        finally:
            browser.close()
