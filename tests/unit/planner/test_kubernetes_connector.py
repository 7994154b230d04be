"""KubernetesConnector against the official client's request contract: a fake API server on
127.0.0.1 records what the client sends (method, path, content type, body); no cluster."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from planner.connectors.base import ConnectorError
from planner.connectors.kubernetes import KubernetesConnector, dns_name
from planner.telemetry.schema import PoolKey

P = PoolKey("org/Llama-3.1-8B", "prefill")
D = PoolKey("org/Llama-3.1-8B", "decode")


class FakeApi(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    replicas: dict[str, int] = {}
    seen: list[tuple[str, str, str, dict | None]] = []
    fail: int | None = None

    def log_message(self, *a):  # quiet
        pass

    def _scale(self, name: str, ns: str) -> dict:
        return {"kind": "Scale", "apiVersion": "autoscaling/v1", "metadata": {"name": name, "namespace": ns},
                "spec": {"replicas": self.replicas.get(name, 0)}, "status": {"replicas": self.replicas.get(name, 0)}}

    def _reply(self, body: dict, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        n = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(n)) if n else None
        type(self).seen.append((method, self.path, self.headers.get("content-type", ""), body))
        parts = self.path.split("?")[0].strip("/").split("/")
        # apis/apps/v1/namespaces/{ns}/deployments/{name}/scale
        if self.fail:
            return self._reply({"kind": "Status", "code": self.fail, "reason": "Forbidden", "message": "nope"}, self.fail)
        if parts[:3] != ["apis", "apps", "v1"] or parts[3] != "namespaces" or parts[5] != "deployments" or parts[7] != "scale":
            return self._reply({"kind": "Status", "code": 404}, 404)
        ns, name = parts[4], parts[6]
        if name not in self.replicas:
            return self._reply({"kind": "Status", "code": 404, "reason": "NotFound"}, 404)
        if method == "PATCH":
            self.replicas[name] = body["spec"]["replicas"]
        self._reply(self._scale(name, ns))

    def do_GET(self):
        self._handle("GET")

    def do_PATCH(self):
        self._handle("PATCH")


@pytest.fixture
def api():
    FakeApi.replicas = {"kvyard-org-llama-3-1-8b-prefill": 1, "kvyard-org-llama-3-1-8b-decode": 2}
    FakeApi.seen = []
    FakeApi.fail = None
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeApi)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def connector(url: str) -> KubernetesConnector:
    from kubernetes import client

    cfg = client.Configuration(host=url)
    return KubernetesConnector([P, D], namespace="llm", api_client=client.ApiClient(cfg))


def test_dns_names():
    assert dns_name("org/Llama-3.1-8B") == "org-llama-3-1-8b"
    assert len(dns_name("x" * 100)) == 63


async def test_reads_and_patches_the_scale_subresource(api):
    c = connector(api)
    assert await c.get_replicas() == {P: 1, D: 2}
    assert await c.set_replicas({P: 3}) == {P: 3}
    method, path, ctype, body = FakeApi.seen[-1]
    assert method == "PATCH"
    assert path == "/apis/apps/v1/namespaces/llm/deployments/kvyard-org-llama-3-1-8b-prefill/scale"
    assert ctype == "application/strategic-merge-patch+json"  # what the official client sends for a dict body
    assert body == {"spec": {"replicas": 3}}
    assert [s[:2] for s in FakeApi.seen[:2]] == [
        ("GET", "/apis/apps/v1/namespaces/llm/deployments/kvyard-org-llama-3-1-8b-prefill/scale"),
        ("GET", "/apis/apps/v1/namespaces/llm/deployments/kvyard-org-llama-3-1-8b-decode/scale"),
    ]
    assert await c.get_replicas() == {P: 3, D: 2}
    await c.close()


async def test_api_errors_become_connector_errors(api):
    c = connector(api)
    FakeApi.fail = 403
    with pytest.raises(ConnectorError, match="403"):
        await c.set_replicas({P: 2})
    await c.close()


async def test_unreachable_api_is_a_connector_error():
    from kubernetes import client

    cfg = client.Configuration(host="http://127.0.0.1:1")
    cfg.retries = 0
    c = KubernetesConnector([P], api_client=client.ApiClient(cfg))
    with pytest.raises(ConnectorError, match="unreachable"):
        await c.get_replicas()
    await c.close()


async def test_explicit_deployment_names(api):
    from kubernetes import client

    FakeApi.replicas["prefill-pool"] = 4
    c = KubernetesConnector([P], namespace="llm", deployments={P: "prefill-pool"},
                            api_client=client.ApiClient(client.Configuration(host=api)))
    assert await c.get_replicas() == {P: 4}
    await c.close()
