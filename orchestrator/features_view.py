"""Read-only views of the LoRA, session and admission state for `/v1/models`, `/api/cluster` and the dashboard.

    model_cards(pool, lora_cfg)        /v1/models data: every served base model, then each configured adapter
                                       whose base model has workers (as vLLM lists them: root = the adapter's
                                       path, parent = its base model)
    cluster_features(router, service)  {"per_worker": {worker: {"adapters": [...], "sessions_pinned": n}},
                                        "cluster": {"sessions": {...}, "admission": {...}, "lora": {...}}}
"""

from __future__ import annotations

import time
from typing import Any

from router.plugins.affinity import SessionAffinity

__all__ = ["cluster_features", "model_cards"]


def model_cards(pool, lora_cfg) -> list[dict[str, Any]]:
    data = []
    models = pool.models()
    for name in models:
        info = pool.info_for(name)
        data.append({"id": name, "object": "model", "created": int(info.started_at if info else time.time()),
                     "owned_by": "kvyard", "root": name, "parent": None,
                     "max_model_len": pool.context_len(name)})  # the smallest among its workers
    for a in lora_cfg.adapters:
        if a.base_model in models:
            info = pool.info_for(a.base_model)
            data.append({"id": a.name, "object": "model", "created": int(info.started_at if info else time.time()),
                         "owned_by": "kvyard", "root": a.path, "parent": a.base_model,
                         "max_model_len": pool.context_len(a.base_model)})
    return data


def cluster_features(router, service) -> dict[str, Any]:
    affinity = next((s for s in router.stages if isinstance(s, SessionAffinity)), None)
    per_worker: dict[str, dict[str, Any]] = {}
    pinned = affinity.pinned_per_worker() if affinity is not None else {}
    lora = service.lora
    for wid in service.pool.workers:
        per_worker[wid] = {"adapters": lora.adapters_of(wid) if lora is not None else [], "sessions_pinned": pinned.get(wid, 0)}
    admission = service.admission
    queues = admission.queued_by_class()
    cluster = {
        "sessions": None if affinity is None else {
            "pinned": sum(pinned.values()), "ttl_s": affinity.ttl_s, "outcomes": dict(affinity.outcomes)},
        "admission": {m: {"inflight": admission.inflight(m), "queued": queues.get(m, {})} for m in sorted(queues)},
        "lora": None if lora is None else {
            "adapters": [{"name": a.name, "base_model": a.base_model, "workers": [w for w in per_worker if a.name in per_worker[w]["adapters"]]}
                         for a in lora.cfg.adapters],
            "failing": lora.failing(), "loads": dict(lora.loads)},
    }
    return {"per_worker": per_worker, "cluster": cluster}
