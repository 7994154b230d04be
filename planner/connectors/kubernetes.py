"""KubernetesConnector: one Deployment per pool, scaled through its `scale` subresource.

    GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   -> spec.replicas
    PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   {"spec": {"replicas": n}}
with the official `kubernetes` client (AppsV1Api.read/patch_namespaced_deployment_scale), run in
a thread so the event loop never blocks. The planner's RBAC needs get/patch on deployments/scale.
Scale-down drains because the pods' preStop/SIGTERM path is the worker's drain (see workers/worker.py)
and the chart's terminationGracePeriodSeconds covers drain_timeout.
Deployment names: `deployments[pool]`, else `name_template.format(model=<dns-safe model>, role=...)`.
"""

from __future__ import annotations

import asyncio
import re

from planner.connectors.base import ConnectorError
from planner.telemetry.schema import PoolKey

__all__ = ["KubernetesConnector", "dns_name"]


def dns_name(text: str) -> str:
    """A DNS-1123 label from a model name: lower case, [a-z0-9-], at most 63 characters."""
    s = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return s[:63].rstrip("-") or "model"


class KubernetesConnector:
    name = "kubernetes"

    def __init__(self, pools: list[PoolKey], namespace: str = "default", *, deployments: dict[PoolKey, str] | None = None,
                 name_template: str = "kvyard-{model}-{role}", api_client=None) -> None:
        from kubernetes import client

        self.pools = list(pools)
        self.namespace = namespace
        self.deployments = {p: (deployments or {}).get(p) or name_template.format(model=dns_name(p.model), role=p.role) for p in pools}
        self._api = client.AppsV1Api(api_client)

    @classmethod
    def from_kubeconfig(cls, pools: list[PoolKey], namespace: str = "default", in_cluster: bool = True, **kw) -> KubernetesConnector:
        from kubernetes import client, config

        try:
            config.load_incluster_config() if in_cluster else config.load_kube_config()
        except config.ConfigException as exc:
            raise ConnectorError(f"no Kubernetes configuration: {exc}") from exc
        return cls(pools, namespace, api_client=client.ApiClient(), **kw)

    async def _call(self, fn, *args, **kw):
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return await asyncio.to_thread(fn, *args, **kw)
        except ApiException as exc:
            raise ConnectorError(f"kubernetes API: {exc.status} {exc.reason}") from exc
        except (HTTPError, OSError) as exc:
            raise ConnectorError(f"kubernetes API unreachable: {exc}") from exc

    async def get_replicas(self) -> dict[PoolKey, int]:
        out = {}
        for pool, name in self.deployments.items():
            scale = await self._call(self._api.read_namespaced_deployment_scale, name, self.namespace)
            out[pool] = int(scale.spec.replicas or 0)
        return out

    async def set_replicas(self, targets: dict[PoolKey, int]) -> dict[PoolKey, int]:
        out = {}
        for pool, n in targets.items():
            name = self.deployments.get(pool)
            if name is None:
                raise ConnectorError(f"no Deployment is configured for pool {pool}")
            scale = await self._call(self._api.patch_namespaced_deployment_scale, name, self.namespace, {"spec": {"replicas": int(n)}})
            out[pool] = int(scale.spec.replicas or 0)
        return out

    async def close(self) -> None:
        api = self._api.api_client
        await asyncio.to_thread(api.close)
