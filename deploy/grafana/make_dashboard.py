"""Writes deploy/grafana/kvyard.json, the Grafana dashboard the Helm chart ships (helm/kvyard/dashboards/
links to it). Edit this script, then run it:

    .venv/bin/python deploy/grafana/make_dashboard.py > deploy/grafana/kvyard.json

Metric names: the frontend's kvyard_* (orchestrator/metrics.py), the engines' vllm:* (also emitted by the
sim engine), the planner's kvyard_planner_* gauges (planner/metrics.py; labels model, role), and three
target gauges the planner does not export yet, assumed here as kvyard_planner_target_ttft_seconds,
kvyard_planner_target_itl_seconds and kvyard_planner_target_tokens_per_second {model, role} (the
TTFT/ITL p90 and tokens/s targets of planner.telemetry.targets, in seconds). pool/role/component
labels on engine series come from the chart's ServiceMonitor relabelings.
"""
import json
DS = {"type": "prometheus", "uid": "${datasource}"}
NS = 'namespace=~"$namespace"'
SEL = NS + ', model=~"$model"'
W = NS + ', pool=~"$pool"'
R = "[$__rate_interval]"
panels = []
pid = [0]
y = [0]

def nid():
    pid[0] += 1
    return pid[0]

def row(title):
    panels.append({"type": "row", "title": title, "id": nid(), "collapsed": False,
                   "gridPos": {"h": 1, "w": 24, "x": 0, "y": y[0]}, "panels": []})
    y[0] += 1

def ts(title, desc, targets, unit, x, w=12, h=8, target_series=(), stack=False, kind="timeseries", dashed_regex=None):
    overrides = []
    if dashed_regex:
        overrides.append({"matcher": {"id": "byRegexp", "options": dashed_regex}, "properties": [
            {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}]})
    for name in target_series:
        overrides.append({"matcher": {"id": "byName", "options": name}, "properties": [
            {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}},
            {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
            {"id": "custom.lineWidth", "value": 2}]})
    p = {"type": kind, "title": title, "description": desc, "id": nid(), "datasource": DS,
         "gridPos": {"h": h, "w": w, "x": x, "y": y[0]},
         "fieldConfig": {"defaults": {"unit": unit}, "overrides": overrides},
         "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                     "tooltip": {"mode": "multi", "sort": "none"}},
         "targets": [{"refId": chr(65 + i), "datasource": DS, "expr": e, "legendFormat": l} for i, (e, l) in enumerate(targets)]}
    if kind == "timeseries":
        p["fieldConfig"]["defaults"]["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if not stack else 40,
                                                  "showPoints": "never", "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    else:
        p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "legend": {"displayMode": "list", "placement": "right", "showLegend": True}} if kind == "piechart" else \
                       {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "orientation": "auto",
                        "colorMode": "value", "graphMode": "area", "textMode": "auto", "justifyMode": "auto"}
    panels.append(p)

def q(h, metric, sel, by=""):
    by_ = f"{by}, le" if by else "le"
    return f"histogram_quantile({h}, sum by ({by_}) (rate({metric}_bucket{{{sel}}}{R})))"

row("Latency and throughput against the planner's targets")
ts("Time to first token", "Frontend-measured TTFT quantiles (kvyard_time_to_first_token_seconds) against the planner's TTFT target (kvyard_planner_target_ttft_seconds, dashed).",
   [(q(0.5, "kvyard_time_to_first_token_seconds", SEL), "p50"), (q(0.9, "kvyard_time_to_first_token_seconds", SEL), "p90"),
    (q(0.99, "kvyard_time_to_first_token_seconds", SEL), "p99"), (f"min(kvyard_planner_target_ttft_seconds{{{SEL}}})", "target")],
   "s", 0, target_series=["target"])
ts("Inter-token latency", "Frontend-measured ITL quantiles (kvyard_inter_token_latency_seconds) against the planner's ITL target (kvyard_planner_target_itl_seconds, dashed).",
   [(q(0.5, "kvyard_inter_token_latency_seconds", SEL), "p50"), (q(0.9, "kvyard_inter_token_latency_seconds", SEL), "p90"),
    (q(0.99, "kvyard_inter_token_latency_seconds", SEL), "p99"), (f"min(kvyard_planner_target_itl_seconds{{{SEL}}})", "target")],
   "s", 12, target_series=["target"])
y[0] += 8
ts("Output tokens/s", "Tokens streamed to clients (sum of kvyard_output_sequence_tokens) and generated per pool by the engines, against the planner's tokens/s target (kvyard_planner_target_tokens_per_second, dashed).",
   [(f"sum(rate(kvyard_output_sequence_tokens_sum{{{SEL}}}{R}))", "frontend"),
    (f"sum by (pool) (rate(vllm:generation_tokens_total{{{W}}}{R}))", "engines {{pool}}"),
    (f"sum(kvyard_planner_target_tokens_per_second{{{SEL}}})", "target")],
   "tps", 0, target_series=["target"])
ts("Requests/s by status", "kvyard_requests_total by status; non-2xx statuses are errors seen by clients.",
   [(f"sum by (status) (rate(kvyard_requests_total{{{SEL}}}{R}))", "{{status}}"),
    (f"sum(kvyard_inflight_requests{{{SEL}}})", "in flight")],
   "reqps", 12)
y[0] += 8
row("Pools")
ts("Replicas per pool", "Per (model, role) pool: replicas the connector reports (kvyard_planner_current_replicas) and the planner's decision (kvyard_planner_desired_replicas, dashed); per chart pool, engines Prometheus scrapes (up).",
   [(f"max by (model, role) (kvyard_planner_current_replicas{{{SEL}}})", "{{model}} {{role}}"),
    (f"max by (model, role) (kvyard_planner_desired_replicas{{{SEL}}})", "{{model}} {{role}} desired"),
    (f'count by (pool) (up{{{W}, component="worker"}} == 1)', "{{pool}} live engines")],
   "short", 0, dashed_regex=".* desired")
ts("KV cache hit rate", "Share of prompt tokens served from the engines' prefix cache (vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total), per pool.",
   [(f"sum by (pool) (rate(vllm:prefix_cache_hits_total{{{W}}}{R})) / clamp_min(sum by (pool) (rate(vllm:prefix_cache_queries_total{{{W}}}{R})), 1)", "{{pool}}")],
   "percentunit", 12)
y[0] += 8
ts("KV cache usage", "Mean KV-cache occupancy of the engines per pool (vllm:kv_cache_usage_perc).",
   [(f"avg by (pool) (vllm:kv_cache_usage_perc{{{W}}})", "{{pool}}")], "percentunit", 0, w=8)
ts("Engine queue", "Requests waiting and running in the engines, per pool.",
   [(f"sum by (pool) (vllm:num_requests_waiting{{{W}}})", "{{pool}} waiting"),
    (f"sum by (pool) (vllm:num_requests_running{{{W}}})", "{{pool}} running")], "short", 8, w=8)
ts("Workers seen by the frontend", "Registered workers by state as the frontends see them in Redis (kvyard_workers).",
   [(f"max by (state) (kvyard_workers{{{SEL}}})", "{{state}}")], "short", 16, w=8)
y[0] += 8
row("Prefill / decode split")
ts("Engines by role", "Live engines per role (both = aggregated).",
   [(f'count by (role) (up{{{NS}, component="worker"}} == 1)', "{{role}}")], "short", 0, w=8, kind="piechart")
ts("Prefill vs decode tokens/s", "Prompt tokens processed and tokens generated per second, by pool role.",
   [(f"sum by (role) (rate(vllm:prompt_tokens_total{{{NS}}}{R}))", "prompt {{role}}"),
    (f"sum by (role) (rate(vllm:generation_tokens_total{{{NS}}}{R}))", "generated {{role}}")], "tps", 8, w=16, stack=True)
y[0] += 8
row("Planner")
ts("Predicted demand", "The planner's forecast per pool (kvyard_planner_predicted_request_rate) against the observed request rate.",
   [(f"max by (model, role) (kvyard_planner_predicted_request_rate{{{SEL}}})", "{{model}} {{role}} predicted"),
    (f"sum by (model) (rate(kvyard_requests_total{{{SEL}}}{R}))", "{{model}} observed")], "reqps", 0, w=8)
ts("Replicas by role", "Prefill / decode / aggregated replicas the planner manages (sum of kvyard_planner_current_replicas by role).",
   [(f"sum by (role) (kvyard_planner_current_replicas{{{SEL}}})", "{{role}}")], "short", 8, w=8, stack=True)
ts("Planner ticks", "Ticks by outcome (kvyard_planner_ticks_total); telemetry_ok 0 means the planner is holding still; advisory 1 means it only records.",
   [(f"sum by (outcome) (increase(kvyard_planner_ticks_total{{{NS}}}[$__range]))", "{{outcome}}"),
    (f"min(kvyard_planner_telemetry_ok{{{NS}}})", "telemetry_ok"),
    (f"max(kvyard_planner_advisory{{{NS}}})", "advisory")], "short", 16, w=8)
y[0] += 8
row("Router")
ts("Routing decisions by worker", "kvyard_router_decisions_total: how the router spreads requests.",
   [(f'sum by (worker) (rate(kvyard_router_decisions_total{{{SEL}}}{R}))', "{{worker}}")], "reqps", 0, w=8, stack=True)
ts("Routing decision time", "p50 and p99 of kvyard_router_decision_seconds.",
   [(q(0.5, "kvyard_router_decision_seconds", NS), "p50"), (q(0.99, "kvyard_router_decision_seconds", NS), "p99")], "s", 8, w=8)
ts("Retries and sequence lengths", "Requests re-sent to another engine (kvyard_engine_retries_total), and median prompt / output lengths.",
   [(f"sum(rate(kvyard_engine_retries_total{{{SEL}}}{R}))", "retries/s"),
    (q(0.5, "kvyard_input_sequence_tokens", SEL), "ISL p50"), (q(0.5, "kvyard_output_sequence_tokens", SEL), "OSL p50")], "short", 16, w=8)
y[0] += 8
row("OpenAI endpoints")
ts("Requests/s by endpoint", "kvyard_requests_total by endpoint: generate (completions, chat), embeddings, responses, tokenize, "
   "detokenize, responses_get / responses_cancel (retrieval by id).",
   [(f'sum by (endpoint) (rate(kvyard_requests_total{{{SEL}, endpoint!~"/.*|unmatched|host_origin_check"}}{R}))', "{{endpoint}}")],
   "reqps", 0, w=8, stack=True)
ts("Failed requests/s by endpoint", "kvyard_requests_total whose status is not ok, by endpoint and status (engine errors, refusals, "
   "client disconnects).",
   [(f'sum by (endpoint, status) (rate(kvyard_requests_total{{{SEL}, status!="ok"}}{R}))', "{{endpoint}} {{status}}")],
   "reqps", 8, w=8)
ts("Routing decision time by quantile", "kvyard_router_decision_seconds over every routed request (generation and the forwarded "
   "endpoints): p50, p90, p99, p99.9.",
   [(q(x, "kvyard_router_decision_seconds", NS), f"p{x * 100:g}") for x in (0.5, 0.9, 0.99, 0.999)], "s", 16, w=8)

def var(name, label, query):
    return {"name": name, "label": label, "type": "query", "datasource": DS, "query": {"query": query, "refId": name},
            "definition": query, "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1, "hide": 0}

dash = {
    "uid": "kvyard-overview", "title": "kvyard", "description": "kvyard: SLA (TTFT, ITL, tokens/s) against planner targets, pools, KV cache, prefill/decode split, router.",
    "tags": ["kvyard", "llm", "inference"], "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
    "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "browser",
    "annotations": {"list": []}, "links": [],
    "templating": {"list": [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus", "hide": 0,
         "current": {"selected": False, "text": "Prometheus", "value": "prometheus"}},
        var("namespace", "Namespace", "label_values(kvyard_requests_total, namespace)"),
        var("model", "Model", 'label_values(kvyard_requests_total{namespace=~"$namespace"}, model)'),
        var("pool", "Pool", 'label_values(up{namespace=~"$namespace", component="worker"}, pool)'),
    ]},
    "panels": panels,
}
if __name__ == "__main__":
    print(json.dumps(dash, indent=2))
