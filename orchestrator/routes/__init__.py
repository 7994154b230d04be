"""The frontend's HTTP routes, one APIRouter module per family; orchestrator/app.py only wires them.

    openai      /v1/completions, /v1/chat/completions, /v1/models
    forwarded   /v1/embeddings, /tokenize, /detokenize, /v1/responses (+ retrieve, cancel)
    ops         /, /live, /health, /metrics
    cluster     /dashboard, /api/cluster
    dashboard   /api/pools
    admin       /admin/targets, /admin/targets/history, /admin/planner/decisions
"""

from orchestrator.routes.admin import make_admin_router
from orchestrator.routes.cluster import make_cluster_router
from orchestrator.routes.dashboard import make_dashboard_router
from orchestrator.routes.forwarded import make_forwarded_router
from orchestrator.routes.openai import hot_routes, make_openai_router
from orchestrator.routes.ops import make_ops_router

__all__ = ["hot_routes", "make_admin_router", "make_cluster_router", "make_dashboard_router", "make_forwarded_router", "make_openai_router", "make_ops_router"]
