"""`kvyard up` with API keys, end to end over real processes: the generated admin token printed in the
dashboard URL and needed for every admin read and write (from this machine too), inference needing a key, and
`kvyard keys revoke` taking effect on the running frontend without a restart. No key in the output."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from orchestrator.testing import free_port, free_port_run

pytestmark = pytest.mark.slow


def _wait_for(pattern: str, path, proc, timeout: float = 90) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, path.read_text(errors="replace"))
        if m:
            return m
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    pytest.fail("kvyard up did not print what was expected:\n" + path.read_text(errors="replace")[-3000:])


def test_up_with_keys_and_generated_admin_token(tmp_path):
    keys_file = tmp_path / "keys.yaml"
    kvyard = [sys.executable, "-m", "orchestrator"]
    made = subprocess.run([*kvyard, "keys", "create", "--file", str(keys_file), "--name", "ci", "--rpm", "100"],
                          capture_output=True, text=True, check=True, cwd=tmp_path)
    key = made.stdout.strip()
    assert key.startswith("kvy_")
    port, base = free_port(), free_port_run(8)
    env = {k: v for k, v in os.environ.items() if k not in ("KVYARD_ADMIN_TOKEN", "KVYARD_API_KEYS_FILE")}
    out = tmp_path / "up.log"
    with open(out, "wb") as log:
        proc = subprocess.Popen([*kvyard, "up", "--workers", "1", "--speedup", "10", "--grpc-port", "0", "--port", str(port),
                                 "--base-port", str(base), "--api-keys-file", str(keys_file)],
                                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
    try:
        m = _wait_for(r"dashboard\s+(http://127\.0\.0\.1:\d+/dashboard#token=([A-Za-z0-9_\-]+))", out, proc)
        token = m.group(2)
        assert "(API keys required)" in out.read_text()
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.get("/api/cluster").status_code == 401  # a token is set: reads from this machine need it too
            assert c.get("/api/cluster", headers={"authorization": f"Bearer {token}"}).status_code == 200
            assert c.get("/dashboard").status_code == 200  # the page (no data) loads; its scripts send the token
            body = {"pools": [{"model": "kvyard-sim", "role": "both", "min_replicas": 1, "max_replicas": 2}]}
            assert c.put("/admin/targets", json=body).status_code == 401
            assert c.put("/admin/targets", json=body, headers={"authorization": f"Bearer {token}"}).status_code == 200
            req = {"model": "kvyard-sim", "prompt": "hello there", "max_tokens": 4}
            r = c.post("/v1/completions", json=req)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = c.post("/v1/completions", json=req, headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "100", r.text
            kid = key.split("_")[1]
            subprocess.run([*kvyard, "keys", "revoke", kid, "--file", str(keys_file)], check=True, capture_output=True, cwd=tmp_path)
            deadline = time.monotonic() + 10
            while (r := c.post("/v1/completions", json=req, headers={"authorization": f"Bearer {key}"})).status_code == 200:
                assert time.monotonic() < deadline, "the revoked key still works"
                time.sleep(0.2)
            assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    text = out.read_text(errors="replace")
    assert key.split("_", 2)[2] not in text  # the key never reached the output (the refusals above were logged by id)
    flat = " ".join(re.sub(r"^\[[\d:]+\]\s+|\s{2,}", " ", line) for line in text.splitlines())  # rich wraps at 80 columns
    assert "refused an API key (revoked" in flat and kid in flat
    assert text.count(token) == 1  # printed once, in the dashboard URL
