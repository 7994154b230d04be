"""The Helm chart (helm/kvyard), rendered offline with the Helm v4 SDK (helm-python-sdk) and checked.

For several value sets (defaults, the examples in deploy/examples/helm, every backend at once) the chart
must lint clean in strict mode, render manifests that `kubernetes-validate --strict` accepts for the
oldest Kubernetes the chart supports and the newest the validator knows (the ServiceMonitor against a
small schema of the fields we use), render identically twice, and carry what an operator relies on:
ports, probes, resources, GPUs, labels, the planner's scale-only Role, the secrets, the dashboard.
Commands rendered into the pods are parsed with kvyard's real argument parser. Bad values files are
refused at template time with a message naming the value.

The tools come from the `dev` extra; if one is missing these tests fail (they never skip).
"""

from __future__ import annotations

import base64
import copy
import importlib
import json
import typing
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kvyard"
HELPERS = REPO / "tests" / "helm"
EXAMPLES = REPO / "deploy" / "examples" / "helm"
DASHBOARD = REPO / "deploy" / "grafana" / "kvyard.json"
RELEASE, NAMESPACE = "demo", "llm"
MIN_K8S = "1.27.0"  # Chart.yaml kubeVersion >=1.27
LINT_K8S = "v1.33.0"

# Target gauges the dashboard draws its "target" lines from. planner/metrics.py does not export them yet;
# they are the TTFT/ITL p90 and tokens/s targets of planner.telemetry.targets, in seconds, {model, role}.
ASSUMED_TARGET_METRICS = {
    "kvyard_planner_target_ttft_seconds", "kvyard_planner_target_itl_seconds", "kvyard_planner_target_tokens_per_second",
}
# Engine metrics (vLLM's names, which the sim engine also emits) the dashboard reads.
ENGINE_METRICS = {
    "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:kv_cache_usage_perc",
    "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
}


def _need(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # fail, never skip: the dev extra installs these
        pytest.fail(f"{extra} is not installed ({exc}); run `make install` (it is in the `dev` extra of pyproject.toml)")


@pytest.fixture(scope="module")
def helm() -> Any:
    mod = _need("helm_python", "helm-python-sdk")
    mod.disable_logging()
    return mod


@pytest.fixture(scope="module")
def kv() -> Any:
    return _need("kubernetes_validate", "kubernetes-validate")


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


REDIS_AUTH = {"redis": {"auth": {"password": "redis-password-0123456789"}}}  # the one value a bundled Redis requires

VALUE_SETS: dict[str, dict] = {
    "default": REDIS_AUTH,
    "external-redis-secret": _load(EXAMPLES / "values-external-redis.yaml"),
    "external-redis-url": {"redis": {"bundled": False, "external": {"url": "rediss://:s3cret@redis.example:6380/2"}},
                           "planner": {"enabled": False}, "grafana": {"dashboard": {"enabled": False}}},
    "vllm-disagg-gpu": _load(EXAMPLES / "values-vllm-disagg.yaml"),
    "sim-only": _load(EXAMPLES / "values-sim.yaml"),
    "all-backends": _load(HELPERS / "values-all-backends.yaml"),
    # TLS from a cert-manager style Secret; API keys and admin token from the operator's own Secret
    "tls-existing-auth": {"redis": {"auth": {"existingSecret": "kvyard-redis-auth"}}, "tls": {"enabled": True, "existingSecret": "kvyard-tls"},
                          "auth": {"existingSecret": "kvyard-credentials", "apiKeysRequired": True},
                          "frontend": {"grpc": {"enabled": True}}},
}


def render(helm: Any, values: dict, name: str = RELEASE, namespace: str = NAMESPACE) -> dict[str, str]:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(values=copy.deepcopy(values), name=name, namespace=namespace)


def docs(rendered: dict[str, str]) -> list[dict]:
    out = []
    for path in sorted(rendered):
        if path.endswith("NOTES.txt"):
            continue
        out.extend(d for d in yaml.safe_load_all(rendered[path]) if d)
    return out


def find(objs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objs: list[dict], kind: str, name: str) -> dict:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {[o['metadata']['name'] for o in find(objs, kind)]}"
    return found[0]


def container(deploy: dict) -> dict:
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


@pytest.fixture(scope="module")
def rendered(helm: Any) -> dict[str, list[dict]]:
    return {name: docs(render(helm, values)) for name, values in VALUE_SETS.items()}


# ---- lint, schema validation, determinism ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_strict_is_clean(helm: Any, name: str) -> None:
    report = helm.lint(str(CHART), values=copy.deepcopy(VALUE_SETS[name]), strict=True, kube_version=LINT_K8S)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert not problems and not report["errors"], f"helm lint --strict ({name}): {problems or report['errors']}"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_manifest_validates_strictly(kv: Any, rendered: dict[str, list[dict]], name: str) -> None:
    import jsonschema

    sm_schema = json.loads((HELPERS / "servicemonitor.schema.json").read_text())
    objs = rendered[name]
    assert objs
    for version in (MIN_K8S, kv.latest_version() + ".0"):
        for obj in objs:
            what = f"{name}: {obj['kind']}/{obj['metadata']['name']} (k8s {version})"
            if obj["kind"] == "ServiceMonitor":
                errors = sorted(jsonschema.Draft7Validator(sm_schema).iter_errors(obj), key=str)
                assert not errors, f"{what}: {errors[0].message} at {list(errors[0].absolute_path)}"
                continue
            try:
                kv.validate(obj, version, strict=True)
            except Exception as exc:  # ValidationError / SchemaNotFoundError: the message says what is wrong
                pytest.fail(f"{what}: {exc}")


def test_kubernetes_validate_cli_accepts_the_default_render(helm: Any, kv: Any, tmp_path: Path) -> None:
    out = tmp_path / "kvyard.yaml"
    out.write_text("\n---\n".join(yaml.safe_dump(d, sort_keys=False) for d in docs(render(helm, REDIS_AUTH))))
    proc = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", "1.33.0", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ERROR" not in proc.stdout


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_render_is_deterministic(helm: Any, name: str) -> None:
    first = render(helm, VALUE_SETS[name])
    second = render(helm, VALUE_SETS[name])
    assert first == second
    assert "randAlpha" not in "".join(p.read_text() for p in (CHART / "templates").iterdir())


def test_examples_are_all_tested() -> None:
    tested = {json.dumps(v, sort_keys=True) for v in VALUE_SETS.values()}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        assert json.dumps(_load(path), sort_keys=True) in tested, f"{path.name} is not in VALUE_SETS"


# ---- bad values are refused with a clear message --------------------------------------------------

POOL = "pools: [{name: agg, backend: sim, model: m}]\n"
BAD_VALUES = {
    # name: (values YAML as a user writes it in -f, fragments the error must contain)
    "negative-frontend-replicas": ("frontend: {replicas: -1}", ["/frontend/replicas", "minimum"]),
    "negative-pool-replicas": ("pools: [{name: agg, backend: sim, model: m, replicas: -2}]", ["/pools/0/replicas", "minimum"]),
    "port-as-string": ("frontend: {httpPort: eighty}", ["/frontend/httpPort", "want integer"]),
    "port-out-of-range": ("frontend: {grpc: {port: 70000}}", ["/frontend/grpc/port", "maximum"]),
    "unknown-top-level-key": ("frontnd: {replicas: 2}", ["additional properties 'frontnd' not allowed"]),
    "unknown-pool-key": ("pools: [{name: agg, backend: sim, model: m, replica: 2}]", ["/pools/0", "'replica' not allowed"]),
    "unknown-backend": ("pools: [{name: agg, backend: tgi, model: m}]", ["/pools/0/backend", "value must be one of 'vllm', 'sglang', 'trtllm', 'sim'"]),
    "unknown-role": ("pools: [{name: agg, backend: sim, role: mixed, model: m}]", ["/pools/0/role", "value must be one of 'both', 'prefill', 'decode'"]),
    "bad-pool-name": ("pools: [{name: Agg_1, backend: sim, model: m}]", ["/pools/0/name", "does not match pattern"]),
    "pool-without-model": ("pools: [{name: agg, backend: sim}]", ["/pools/0", "missing property 'model'"]),
    "no-pools": ("pools: []", ["/pools", "minItems"]),
    "gpus-as-text": ("pools: [{name: agg, backend: vllm, model: m, gpus: one}]", ["/pools/0/gpus", "want integer"]),
    "engine-args-not-strings": ("pools: [{name: agg, backend: sim, model: m, engineArgs: [--seed, 3]}]",
                                ["/pools/0/engineArgs/1", "want string"]),
    "bad-sglang-connector": ("pools: [{name: p, backend: sglang, role: prefill, model: m, pd: {connector: nccl}},"
                             " {name: d, backend: sglang, role: decode, model: m, pd: {connector: mooncake}}]",
                             ["/pools/0/pd/connector", "value must be one of '', 'mooncake'"]),
    "bad-policy": ("frontend: {policy: fastest}", ["/frontend/policy", "value must be one of"]),
    "bad-log-level": ("logLevel: verbose", ["/logLevel", "value must be one of"]),
    "bad-redis-url": ("redis: {bundled: false, external: {url: 'localhost:6379'}}", ["/redis/external/url", "does not match pattern"]),
    "bad-interval": ("metrics: {serviceMonitor: {enabled: true, interval: 15 seconds}}", ["/metrics/serviceMonitor/interval"]),
    "short-admin-token": ("auth: {adminToken: hunter2}", ["/auth/adminToken", "does not match pattern"]),
    "negative-target": ("planner: {targets: {ttftMs: -5}}", ["/planner/targets/ttftMs", "exclusiveMinimum"]),
    "bad-planner-mode": ("planner: {mode: aggressive}", ["/planner/mode", "value must be one of 'sla', 'load', 'hybrid'"]),
    "unknown-planner-setting": ("planner: {config: {cooldown: 5}}", ["/planner/config", "'cooldown' not allowed"]),
    "max-replicas-zero": ("pools: [{name: agg, backend: sim, model: m, replicas: 0, maxReplicas: 0}]", ["/pools/0/maxReplicas", "minimum"]),
    # cross-field rules, enforced in templates (messages start with "kvyard:")
    "duplicate-pool-names": ("pools: [{name: agg, backend: sim, model: m}, {name: agg, backend: sim, model: other}]",
                             ["kvyard: pools[1]", "\"agg\" is used twice"]),
    "prefill-without-decode": ("pools: [{name: p, backend: sim, role: prefill, model: m}]", ["kvyard: pool p", "no decode pool"]),
    "decode-without-prefill": ("pools: [{name: d, backend: sim, role: decode, model: m}]", ["kvyard: pool d", "no prefill pool"]),
    "vllm-pd-without-connector": ("pools: [{name: p, backend: vllm, role: prefill, model: m}, {name: d, backend: vllm, role: decode,"
                                  " model: m, pd: {connector: NixlConnector}}]", ["kvyard: pools[0] (p)", "needs pd.connector"]),
    "same-model-and-role-twice": ("pools: [{name: a, backend: sim, model: m}, {name: b, backend: sim, model: m}]",
                                  ["kvyard: pools[1] (b)", "pool a already serves \"m\" as both"]),
    "gpu-budget-below-floor": ("planner: {gpuBudget: 3}\npools: [{name: agg, backend: vllm, model: m, gpus: 2, replicas: 2, minReplicas: 2}]",
                               ["kvyard: planner.gpuBudget 3 is below the 4 GPUs"]),
    "replicas-above-max": ("pools: [{name: agg, backend: sim, model: m, replicas: 5, maxReplicas: 3}]",
                           ["kvyard: pools[0] (agg)", "above maxReplicas 3"]),
    "replicas-below-min": ("pools: [{name: agg, backend: sim, model: m, replicas: 0, minReplicas: 1}]",
                           ["kvyard: pools[0] (agg)", "below minReplicas 1"]),
    "tracing-without-endpoint": ("tracing: {enabled: true}\nredis: {auth: {password: 0123456789abcdef0123}}", ["kvyard: tracing.enabled needs tracing.endpoint"]),
    "bad-tracing-protocol": ("tracing: {protocol: zipkin}", ["/tracing/protocol", "value must be one of 'grpc', 'http/protobuf'"]),
    "engine-config-on-vllm": ("pools: [{name: agg, backend: vllm, model: m, engineConfig: {a: 1}}]",
                              ["kvyard: pools[0] (agg)", "trtllm pools only"]),
    "kv-port-equals-port": ("poolDefaults: {port: 8100, kvEvents: {port: 8100}}", ["kvyard: pools[0]", "kvEvents.port must differ"]),
    "external-redis-without-url": ("redis: {bundled: false}", ["kvyard: redis.bundled is false", "redis.external.url"]),
    "external-and-bundled-redis": ("redis: {external: {url: 'redis://r:6379/0'}}", ["kvyard: redis.external is set", "bundled"]),
    "existing-secret-and-keys": ("auth: {existingSecret: mine, apiKeys: [{id: 0123456789ab, hash: 'sha256:" + "0" * 64 + "'}]}",
                                 ["kvyard: auth.existingSecret is set"]),
    "plaintext-api-key": ("auth: {apiKeys: [kvy_0123456789ab_secret]}", ["/auth/apiKeys/0", "want object"]),
    "api-key-without-hash": ("auth: {apiKeys: [{id: 0123456789ab, key: kvy_0123456789ab_secret}]}",
                             ["/auth/apiKeys/0", "missing property 'hash'"]),
    "api-key-bad-hash": ("auth: {apiKeys: [{id: 0123456789ab, hash: 'md5:abc'}]}", ["/auth/apiKeys/0/hash", "does not match pattern"]),
    "api-key-zero-rpm": ("auth: {apiKeys: [{id: 0123456789ab, hash: 'sha256:" + "0" * 64 + "', rpm: 0}]}",
                         ["/auth/apiKeys/0/rpm", "minimum"]),
    "bundled-redis-without-password": ("logLevel: info", ["kvyard: the bundled Redis needs a password"]),
    "short-redis-password": ("redis: {auth: {password: short}}", ["/redis/auth/password"]),
    "tls-without-secret": ("tls: {enabled: true}", ["kvyard: tls.enabled needs tls.existingSecret"]),
    "unknown-tls-key": ("tls: {enabled: true, certificate: abc}", ["/tls", "'certificate' not allowed"]),
    "http-and-grpc-same-port": ("frontend: {httpPort: 8000, grpc: {port: 8000}}", ["kvyard: frontend.httpPort and frontend.grpc.port"]),
    "pool-name-too-long-for-release": ("fullnameOverride: " + "x" * 40 + "\npools: [{name: " + "p" * 20 + ", backend: sim, model: m}]",
                                       ["kvyard: pools[0]", "limit 63"]),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_file_is_refused(helm: Any, tmp_path: Path, case: str) -> None:
    text, fragments = BAD_VALUES[case]
    values_file = tmp_path / "values.yaml"
    values_file.write_text(text + "\n")
    values = helm.values_from_yaml(values_file.read_text())  # what `-f values.yaml` does
    with pytest.raises(helm.HelmError) as info:
        render(helm, values)
    message = str(info.value)
    assert isinstance(info.value, (helm.HelmValuesError, helm.HelmRenderError)), type(info.value)
    for fragment in fragments:
        assert fragment in message, f"{case}: {fragment!r} not in error:\n{message}"
    assert len(message) < 2000, f"{case}: error too long to read:\n{message}"
    if not fragments[0].startswith("kvyard:"):  # helm lint runs `fail` in lint mode (logged, not an error)
        report = helm.lint(str(CHART), values=values, strict=True, kube_version=LINT_K8S)
        assert report["errors"], f"{case}: helm lint accepted it"


def test_schema_violations_are_all_reported_at_once(helm: Any) -> None:
    values = helm.values_from_yaml("frontend: {replicas: -1, httpPort: x}\nlogLevel: loud\n")
    with pytest.raises(helm.HelmValuesError) as info:
        render(helm, values)
    for path in ("/frontend/replicas", "/frontend/httpPort", "/logLevel"):
        assert path in str(info.value)


# ---- what operators rely on -----------------------------------------------------------------------


def test_frontend_ports_probes_resources(rendered: dict[str, list[dict]]) -> None:
    objs = rendered["default"]
    dep = one(objs, "Deployment", "demo-kvyard-frontend")
    c = container(dep)
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "grpc": 8001}
    assert c["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    svc = one(objs, "Service", "demo-kvyard-frontend")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {"http": (8000, "http"), "grpc": (8001, "grpc")}
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert "--grpc-port=8001" not in c["args"]  # only when frontend.grpc.enabled
    fe_all = container(one(rendered["all-backends"], "Deployment", "kv-frontend"))
    assert "--grpc-port=9001" in fe_all["args"] and {p["containerPort"] for p in fe_all["ports"]} == {9000, 9001}


def test_frontend_config_file_reaches_the_frontend(rendered: dict[str, list[dict]]) -> None:
    objs = rendered["all-backends"]
    cm = one(objs, "ConfigMap", "kv-frontend")
    assert yaml.safe_load(cm["data"]["frontend.yaml"]) == {"frontend": {
        "resilience": {"max_attempts": 2, "first_byte_timeout_s": 120}, "header_timeout_s": 10,
        "security": {"allowed_hosts": ["kvyard.example.com"], "request_fields": {"allow": ["priority"], "unknown": "drop"}},
        "telemetry": {"tracing": {"enabled": True, "endpoint": "http://tempo.monitoring:4317", "protocol": "grpc", "sample_ratio": 0.5}}}}
    dep = one(objs, "Deployment", "kv-frontend")
    assert "--config=/etc/kvyard/frontend.yaml" in container(dep)["args"]
    mounts = {m["name"]: m["mountPath"] for m in container(dep)["volumeMounts"]}
    assert mounts["config"] == "/etc/kvyard"
    # the config is loaded by the real FrontendConfig (unknown keys raise)
    from orchestrator.config import FrontendConfig

    FrontendConfig(**yaml.safe_load(cm["data"]["frontend.yaml"])["frontend"])
    schema_keys = json.loads((CHART / "values.schema.json").read_text())["properties"]["frontend"]["properties"]["config"]["properties"]
    assert set(schema_keys) <= set(FrontendConfig.model_fields), "values.schema.json types a key FrontendConfig lacks"


def test_worker_pools_gpus_ports_probes(rendered: dict[str, list[dict]]) -> None:
    objs = rendered["vllm-disagg-gpu"]
    for pool, role, replicas, engine_args in (
        ("prefill", "prefill", 2, ["--gpu-memory-utilization", "0.9", "--max-num-batched-tokens", "16384"]),
        ("decode", "decode", 4, ["--gpu-memory-utilization", "0.9"]),
    ):
        dep = one(objs, "Deployment", f"demo-kvyard-pool-{pool}")
        spec = dep["spec"]["template"]["spec"]
        c = container(dep)
        assert dep["spec"]["replicas"] == replicas
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["requests"]["memory"] == "48Gi"
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8100, "kv-events": 9100, "kv-replay": 9101, "nixl": 5600}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
        args = c["args"]
        assert args[:3] == ["worker", "--backend=vllm", f"--role={role}"]
        assert "--advertise-host=$(POD_IP)" in args and "--redis-url=$(KVYARD_REDIS_URL)" in args
        assert "--kv-events-port=9100" in args and "--engine-python=python3" in args
        tail = args[args.index("--") + 1:]
        ktc = json.loads(tail[tail.index("--kv-transfer-config") + 1])
        assert ktc == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        assert tail[2:] == engine_args, "the PD connector comes first, then the pool's engineArgs"
        env = env_of(c)
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)"
        assert env["HF_HUB_OFFLINE"]["value"] == "1"
        assert spec["terminationGracePeriodSeconds"] == 90
        assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
        assert vols["models"]["persistentVolumeClaim"]["claimName"] == "llama-weights"
        assert dep["spec"]["template"]["metadata"]["labels"]["kvyard.io/role"] == role
        assert c["image"] == "registry.example.com/kvyard-vllm:0.1.0"
    # the frontend sees the model directory the workers register as their tokenizer folder
    fe = one(objs, "Deployment", "demo-kvyard-frontend")
    assert {m["mountPath"] for m in container(fe)["volumeMounts"] if m["name"] == "models"} == {"/models"}
    assert {v["name"] for v in fe["spec"]["template"]["spec"]["volumes"]} >= {"config", "tmp", "models"}


def test_tracing_values_reach_the_frontend_and_the_vllm_engines(rendered: dict[str, list[dict]]) -> None:
    objs = rendered["all-backends"]
    c = container(one(objs, "Deployment", "kv-pool-vllm-agg"))
    tail = c["args"][c["args"].index("--") + 1:]
    assert tail[tail.index("--otlp-traces-endpoint") + 1] == "http://tempo.monitoring:4317"
    assert env_of(c)["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"]["value"] == "grpc"
    sg = container(one(objs, "Deployment", "kv-pool-sg-prefill"))
    assert "--otlp-traces-endpoint" not in sg["args"]  # only vLLM takes the flag
    for obj in rendered["default"]:  # off by default: nothing traced
        assert "otlp" not in json.dumps(obj).lower()


def test_sglang_and_trtllm_pd_settings(rendered: dict[str, list[dict]]) -> None:
    objs = rendered["all-backends"]
    pre = container(one(objs, "Deployment", "kv-pool-sg-prefill"))
    tail = pre["args"][pre["args"].index("--") + 1:]
    assert tail == ["--disaggregation-transfer-backend", "mooncake", "--disaggregation-mode", "prefill",
                    "--disaggregation-bootstrap-port", "8998"]
    assert {p["name"] for p in pre["ports"]} == {"http", "kv-events", "kv-replay", "bootstrap"}
    dec = container(one(objs, "Deployment", "kv-pool-sg-decode"))
    assert dec["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert "--disaggregation-bootstrap-port" not in dec["args"]
    cm = one(objs, "ConfigMap", "kv-pool-trt-ctx-engine")
    assert yaml.safe_load(cm["data"]["extra-llm-api-options.yaml"]) == {
        "cache_transceiver_config": {"backend": "NIXL"},
        "kv_cache_config": {"enable_block_reuse": True, "event_buffer_max_size": 1024}}
    trt = one(objs, "Deployment", "kv-pool-trt-ctx")
    c = container(trt)
    assert c["args"][-2:] == ["--extra_llm_api_options", "/etc/kvyard/engine/extra-llm-api-options.yaml"]
    assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["engine-config"] == "/etc/kvyard/engine"
    vllm = one(objs, "Deployment", "kv-pool-vllm-agg")
    assert vllm["spec"]["replicas"] == 0
    assert container(vllm)["image"] == "registry.example.com/custom-vllm:dev"
    assert container(vllm)["imagePullPolicy"] == "Always"
    assert "--engine-python=/opt/venv/bin/python" in container(vllm)["args"]
    sim = container(one(objs, "Deployment", "kv-pool-sim"))
    assert "nvidia.com/gpu" not in sim["resources"].get("limits", {}) and "--" not in sim["args"]
    assert sim["image"] == "kvyard:0.1.0"


def test_planner_role_grants_only_scaling_the_pools(rendered: dict[str, list[dict]]) -> None:
    for name in ("default", "vllm-disagg-gpu", "all-backends"):
        objs = rendered[name]
        assert not find(objs, "ClusterRole") and not find(objs, "ClusterRoleBinding")
        (role,) = find(objs, "Role")
        pools = sorted(d["metadata"]["name"] for d in find(objs, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker")
        assert pools
        rules = copy.deepcopy(role["rules"])
        rules[-1]["resourceNames"] = sorted(rules[-1].get("resourceNames", []))
        assert rules == [
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "list"]},
            {"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": pools, "verbs": ["get", "patch", "update"]},
        ], name
        assert "namespace" not in role["metadata"]
        (binding,) = find(objs, "RoleBinding")
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
        (planner,) = [d for d in find(objs, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"] == "planner"]
        sa = planner["spec"]["template"]["spec"]["serviceAccountName"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
        assert bool(find(objs, "ServiceAccount", sa)) == (name != "all-backends")  # all-backends brings its own SA
        for dep in find(objs, "Deployment"):
            if dep is not planner:
                assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is False, dep["metadata"]["name"]
    assert not find(rendered["external-redis-url"], "Role")  # planner disabled: no RBAC at all


def _planner_file(objs: list[dict], name: str) -> dict:
    return yaml.safe_load(one(objs, "ConfigMap", name)["data"]["planner.yaml"])


def test_planner_config_loads_with_the_real_models(rendered: dict[str, list[dict]]) -> None:
    from planner.config import PlannerConfig
    from planner.telemetry.targets import Targets

    for name, cm in (("default", "demo-kvyard-planner"), ("vllm-disagg-gpu", "demo-kvyard-planner"), ("sim-only", "demo-kvyard-planner"),
                     ("all-backends", "kv-planner")):
        doc = _planner_file(rendered[name], cm)
        assert set(doc) == {"connector", "metrics_port", "planner", "targets", "kubernetes"}
        assert doc["connector"] == "kubernetes" and doc["kubernetes"]["namespace"] == NAMESPACE
        PlannerConfig(**doc["planner"])  # extra="forbid": a misspelt key fails here
        targets = Targets(**doc["targets"])
        pools = {d["metadata"]["name"]: d for d in find(rendered[name], "Deployment")
                 if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"}
        mapping = {(d["model"], d["role"]): d["deployment"] for d in doc["kubernetes"]["deployments"]}
        assert sorted(mapping.values()) == sorted(pools), name
        for (model, role), dep_name in mapping.items():
            meta = pools[dep_name]["metadata"]
            assert meta["annotations"]["kvyard.io/served-model-name"] == model and meta["labels"]["kvyard.io/role"] == role
            assert targets.pool(model, role) is not None
    doc = _planner_file(rendered["vllm-disagg-gpu"], "demo-kvyard-planner")
    assert doc["planner"] == {"mode": "hybrid", "advisory": False, "interval_s": 60, "default_ttft_ms": 300, "default_itl_ms": 25}
    assert doc["targets"]["gpu_budget"] == 16
    assert [(p["role"], p["min_replicas"], p["max_replicas"], p["gpus_per_replica"], p["ttft_p90_ms"], p.get("tokens_per_s"))
            for p in doc["targets"]["pools"]] == [("prefill", 1, 6, 1, 300, None), ("decode", 2, 10, 1, 300, 20000)]
    extra = _planner_file(rendered["all-backends"], "kv-planner")["planner"]
    assert extra["scale_down_cooldown_s"] == 120 and extra["advisory"] is True and extra["mode"] == "load"
    schema = json.loads((CHART / "values.schema.json").read_text())
    config_keys = set(schema["properties"]["planner"]["properties"]["config"]["properties"])
    assert config_keys <= set(PlannerConfig.model_fields), "values.schema.json types a planner key PlannerConfig lacks"
    predictors = schema["properties"]["planner"]["properties"]["config"]["properties"]["predictor"]["enum"]
    assert predictors == list(typing.get_args(PlannerConfig.model_fields["predictor"].annotation)), "the chart's predictor list is stale"
    dedicated = {"mode", "advisory", "interval_s", "default_ttft_ms", "default_itl_ms"}
    assert dedicated <= set(PlannerConfig.model_fields) and not dedicated & config_keys


def test_planner_deployment(rendered: dict[str, list[dict]]) -> None:
    dep = one(rendered["vllm-disagg-gpu"], "Deployment", "demo-kvyard-planner")
    c = container(dep)
    assert c["args"] == ["planner", "--redis-url=$(KVYARD_REDIS_URL)", "--discovery-prefix=kvyard", "--config=/etc/kvyard/planner.yaml"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": 9090}
    assert c["livenessProbe"] and c["readinessProbe"] and c["resources"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}


def test_redis_bundled_or_external(rendered: dict[str, list[dict]]) -> None:
    objs = rendered["default"]
    redis = one(objs, "Deployment", "demo-kvyard-redis")
    c = container(redis)
    assert "--appendonly" in c["args"] and c["args"][c["args"].index("--save") + 1] == ""
    assert c["livenessProbe"]["exec"] and c["readinessProbe"]["exec"] and c["resources"]["limits"]["memory"]
    assert one(objs, "Service", "demo-kvyard-redis")["spec"]["ports"][0]["port"] == 6379
    # a password from the Secret (expanded by the kubelet, in no manifest), no eviction of state that must stay
    assert c["args"][c["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert c["args"][c["args"].index("--maxmemory-policy") + 1] == "noeviction" and "allkeys-lru" not in c["args"]
    ref = {"name": "demo-kvyard-redis-auth", "key": "redis-password"}
    assert env_of(c)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == ref and env_of(c)["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == ref
    secret = one(objs, "Secret", "demo-kvyard-redis-auth")
    assert base64.b64decode(secret["data"]["redis-password"]).decode() == "redis-password-0123456789"
    for dep in find(objs, "Deployment"):
        if dep["metadata"]["name"] != "demo-kvyard-redis":
            env = [e for e in container(dep)["env"] if e["name"] in ("KVYARD_REDIS_PASSWORD", "KVYARD_REDIS_URL")]
            assert env == [{"name": "KVYARD_REDIS_PASSWORD", "valueFrom": {"secretKeyRef": ref}},  # defined first: the URL uses it
                           {"name": "KVYARD_REDIS_URL", "value": "redis://:$(KVYARD_REDIS_PASSWORD)@demo-kvyard-redis:6379/0"}]
    assert "redis-password-0123456789" not in yaml.safe_dump_all([o for o in objs if o["kind"] != "Secret"])
    # only this release's kvyard pods reach it
    pol = one(objs, "NetworkPolicy", "demo-kvyard-redis")
    assert pol["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "redis"
    (rule,) = pol["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvyard", "app.kubernetes.io/instance": "demo"}}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    for dep in find(objs, "Deployment"):  # every kvyard pod matches the policy's peer selector
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kvyard" and labels["app.kubernetes.io/instance"] == "demo"
    extra = one(rendered["all-backends"], "NetworkPolicy", "kv-redis")["spec"]["ingress"][0]["from"]
    assert extra[1] == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    # the examples take the password from an existing Secret
    sim = container(one(rendered["sim-only"], "Deployment", "demo-kvyard-redis"))
    assert env_of(sim)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "kvyard-redis-auth", "key": "redis-password"}
    assert not find(rendered["sim-only"], "Secret", "demo-kvyard-redis-auth")


def test_registry_signing_secret_reaches_every_kvyard_pod(rendered: dict[str, list[dict]]) -> None:
    objs = rendered["all-backends"]
    secret = one(objs, "Secret", "kv-registry")
    assert base64.b64decode(secret["data"]["registry-secret"]).decode() == "registry-signing-secret-0123456789"
    deps = [d for d in find(objs, "Deployment") if d["metadata"]["name"] != "kv-redis"]
    assert len(deps) > 3
    for dep in deps:
        ref = env_of(container(dep))["KVYARD_REGISTRY_SECRET"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "kv-registry", "key": "registry-secret"}, dep["metadata"]["name"]
    ex = env_of(container(one(rendered["vllm-disagg-gpu"], "Deployment", "demo-kvyard-frontend")))
    assert ex["KVYARD_REGISTRY_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": "kvyard-cluster", "key": "registry-secret"}
    assert "KVYARD_REGISTRY_SECRET" not in env_of(container(one(rendered["default"], "Deployment", "demo-kvyard-frontend")))

    ext = rendered["external-redis-url"]
    assert not find(ext, "Deployment", "demo-kvyard-redis") and not find(ext, "Service", "demo-kvyard-redis")
    (secret,) = find(ext, "Secret", "demo-kvyard-redis-url")
    assert base64.b64decode(secret["data"]["redis-url"]).decode() == "rediss://:s3cret@redis.example:6380/2"
    ref = env_of(container(one(ext, "Deployment", "demo-kvyard-pool-agg")))["KVYARD_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "demo-kvyard-redis-url", "key": "redis-url"}
    assert "s3cret" not in yaml.safe_dump_all([o for o in ext if o["kind"] != "Secret"])  # the password stays in the Secret

    es = rendered["external-redis-secret"]
    assert not find(es, "Secret")  # both secrets are the user's
    ref = env_of(container(one(es, "Deployment", "demo-kvyard-frontend")))["KVYARD_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "kvyard-redis", "key": "redis-url"}


def test_auth_secret(rendered: dict[str, list[dict]]) -> None:
    objs = rendered["all-backends"]
    secret = one(objs, "Secret", "kv-auth")
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(data) == {"api-keys.yaml", "admin-token"} and data["admin-token"] == "admin-token-0123456789abcdef"
    # the Secret holds a key file (hashes) that kvyard's own loader accepts, and keys the test vouches for verify
    from orchestrator.security import KeyStore

    key_file = Path(__import__("tempfile").mkdtemp()) / "api-keys.yaml"
    key_file.write_text(data["api-keys.yaml"])
    store = KeyStore(key_file)
    principal, _ = store.verify("kvy_0123456789ab_test-key-aaaaaaaa")
    assert (principal.name, principal.rpm, principal.tpm) == ("team-a", 600, 200000)
    assert store.verify("kvy_ba9876543210_test-key-bbbbbbbb") == (None, "revoked")
    assert "test-key-aaaaaaaa" not in yaml.safe_dump_all(objs)  # no key itself anywhere, Secret included
    dep = one(objs, "Deployment", "kv-frontend")
    c = container(dep)
    env = env_of(c)
    assert "KVYARD_API_KEYS" not in env
    assert env["KVYARD_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "kv-auth", "key": "admin-token"}
    assert "--api-keys-file=/etc/kvyard/auth/api-keys.yaml" in c["args"]
    assert {"name": "api-keys", "mountPath": "/etc/kvyard/auth", "readOnly": True} in c["volumeMounts"]
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "api-keys")
    assert vol["secret"] == {"secretName": "kv-auth", "defaultMode": 0o440, "items": [{"key": "api-keys.yaml", "path": "api-keys.yaml"}]}
    assert dep["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 10001  # the non-root user can read it
    assert "admin-token-0123456789abcdef" not in yaml.safe_dump_all([o for o in objs if o["kind"] != "Secret"])
    es = env_of(container(one(rendered["external-redis-secret"], "Deployment", "demo-kvyard-frontend")))
    assert es["KVYARD_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "kvyard-auth", "key": "admin-token", "optional": True}
    # a changed secret rolls the frontend
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert re.fullmatch(r"[0-9a-f]{64}", ann["checksum/auth"])
    # defaults: no key file mounted, no key needed (the frontend warns), no TLS
    d = container(one(rendered["default"], "Deployment", "demo-kvyard-frontend"))
    assert not any(a.startswith(("--api-keys-file", "--tls-")) for a in d["args"])
    assert {m["name"] for m in d["volumeMounts"]} == {"config", "tmp"}


def test_tls_and_keys_from_existing_secrets(rendered: dict[str, list[dict]]) -> None:
    objs = rendered["tls-existing-auth"]
    assert not find(objs, "Secret")  # every Secret is the operator's
    dep = one(objs, "Deployment", "demo-kvyard-frontend")
    c = container(dep)
    assert {"--tls-cert=/etc/kvyard/tls/tls.crt", "--tls-key=/etc/kvyard/tls/tls.key",
            "--api-keys-file=/etc/kvyard/auth/api-keys.yaml", "--grpc-port=8001"} <= set(c["args"])
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["tls"]["secret"]["secretName"] == "kvyard-tls"
    assert [i["key"] for i in vols["tls"]["secret"]["items"]] == ["tls.crt", "tls.key"]
    assert vols["api-keys"]["secret"]["secretName"] == "kvyard-credentials"
    assert {"name": "tls", "mountPath": "/etc/kvyard/tls", "readOnly": True} in c["volumeMounts"]
    # kubelet probes the TLS port over HTTPS
    assert c["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http", "scheme": "HTTPS"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
    # the rendered command parses with kvyard's CLI into a config with TLS and keys
    from orchestrator.cli import build_parser, frontend_config

    ns = build_parser().parse_args(_substitute(c["args"]))
    ns.config = None  # the ConfigMap's file lives in the pod
    sec = frontend_config(ns, environ={}).security
    assert tuple(map(str, (sec.tls_cert_file, sec.tls_key_file, sec.api_keys_file))) == (
        "/etc/kvyard/tls/tls.crt", "/etc/kvyard/tls/tls.key", "/etc/kvyard/auth/api-keys.yaml")


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_labels_names_and_no_hardcoded_namespace(rendered: dict[str, list[dict]], name: str) -> None:
    objs = rendered[name]
    seen = set()
    for obj in objs:
        meta = obj["metadata"]
        key = (obj["kind"], meta["name"])
        assert key not in seen, f"duplicate {key}"
        seen.add(key)
        assert "namespace" not in meta, f"{key} hard-codes a namespace"
        assert len(meta["name"]) <= 63
        labels = meta["labels"]
        for label in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
                      "app.kubernetes.io/managed-by", "app.kubernetes.io/version", "app.kubernetes.io/part-of", "helm.sh/chart"):
            assert label in labels, f"{key} lacks {label}"
        if obj["kind"] == "Deployment":
            pod = obj["spec"]["template"]
            assert obj["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
            c = container(obj)
            assert c["resources"].get("requests") and c["resources"].get("limits"), f"{key} lacks requests/limits"
            assert c.get("livenessProbe") and c.get("readinessProbe"), f"{key} lacks probes"
            assert ":" in c["image"] and c["image"].split(":")[-1], c["image"]
    if name == "all-backends":
        assert all(o["metadata"]["labels"]["team"] == "inference" for o in objs)
        assert all(d["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}] for d in find(objs, "Deployment"))


def test_release_name_and_namespace_flow_through(helm: Any) -> None:
    objs = docs(render(helm, REDIS_AUTH, name="kvyard", namespace="team-a"))
    assert one(objs, "Deployment", "kvyard-frontend")  # release named like the chart: no "kvyard-kvyard"
    (binding,) = find(objs, "RoleBinding")
    assert binding["subjects"][0]["namespace"] == "team-a"
    long = docs(render(helm, REDIS_AUTH, name="a-very-long-release-name-for-a-production-cluster-x"))
    assert all(len(o["metadata"]["name"]) <= 63 for o in long)


# ---- the commands in the pods are the real CLI ----------------------------------------------------


def _substitute(args: list[str]) -> list[str]:
    env = {"POD_IP": "10.0.0.7", "KVYARD_REDIS_URL": "redis://demo-kvyard-redis:6379/0"}
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def test_rendered_commands_parse_with_the_real_cli(rendered: dict[str, list[dict]]) -> None:
    from orchestrator.cli import build_parser, frontend_config, worker_config
    from workers.registry import backend_names

    parser = build_parser()
    subcommands = set(parser._subparsers._group_actions[0].choices)  # noqa: SLF001 (argparse has no public accessor)
    checked = 0
    for name in ("default", "sim-only", "vllm-disagg-gpu", "external-redis-url", "all-backends"):
        for dep in find(rendered[name], "Deployment"):
            c = container(dep)
            if c.get("command") != ["kvyard"]:
                continue
            args = _substitute(c["args"])
            if name == "all-backends" and args[0] != "worker":
                continue  # its frontend carries a made-up extraArgs flag (a pass-through test, not a real flag)
            if args[0] == "worker":  # every backend the chart renders is one the CLI runs
                assert args[1].split("=", 1)[1] in backend_names(), args[1]
            if args[0] not in subcommands:
                assert args[0] == "planner", args  # the planner command lands with the planner issue
                continue
            ns = parser.parse_args(args)
            ns.config = None  # a ConfigMap's file lives in the pod
            checked += 1
            if args[0] == "worker":  # the typed config the worker would run with
                w = worker_config(ns, environ={})
                assert w.host == "0.0.0.0" and w.advertise_host == "10.0.0.7" and w.redis_url.startswith("redis")
                assert w.role.value in ("both", "prefill", "decode")
            if args[0] == "frontend":
                f = frontend_config(ns, environ={})
                assert (f.host, f.port, f.redis_url) == ("0.0.0.0", 8000, _substitute(["$(KVYARD_REDIS_URL)"])[0])
    assert checked >= 12


def _worker_engine(objs: list[dict], deployment: str, tmp_path: Path):
    """What `kvyard worker` in this pool would start: (backend, EngineLaunchConfig, WorkerOptions, LaunchSpec), the
    pool's engine ConfigMap (trtllm) written where the pod mounts it (a path under tmp_path here)."""
    from orchestrator.cli import build_parser, worker_config
    from orchestrator.commands import worker_setup

    args = _substitute(container(one(objs, "Deployment", deployment))["args"])
    mounted = "/etc/kvyard/engine/extra-llm-api-options.yaml"
    if mounted in args:
        local = tmp_path / f"{deployment}.yaml"
        local.write_text(one(objs, "ConfigMap", f"{deployment}-engine")["data"]["extra-llm-api-options.yaml"])
        args = [str(local) if a == mounted else a for a in args]
    backend, cfg, opts = worker_setup(worker_config(build_parser().parse_args(args), environ={}))
    return backend, cfg, opts, backend.launch_spec(cfg)


def test_sglang_and_trtllm_pools_start_the_engine_they_describe(rendered: dict[str, list[dict]], tmp_path: Path) -> None:
    """The rendered worker commands, run through kvyard's own worker setup and backends: the SGLang engine gets its
    role, bootstrap port and transfer backend; the TRT-LLM engine's YAML is the pool's engineConfig merged over
    kvyard's (checked against TRT-LLM's names in tests/unit/workers/trtllm); the engines' ports match the pod's."""
    objs = rendered["all-backends"]
    backend, cfg, opts, spec = _worker_engine(objs, "kv-pool-sg-prefill", tmp_path)
    assert backend.name == "sglang" and spec.argv[1:3] == ["-m", "sglang.launch_server"] and spec.argv[0] == "python3"
    argv = spec.argv
    assert argv[argv.index("--disaggregation-mode") + 1] == "prefill" and argv.count("--disaggregation-mode") == 1
    assert argv[argv.index("--disaggregation-transfer-backend") + 1] == "mooncake"
    assert (opts.bootstrap_port, opts.role.value) == (8998, "prefill")
    ports = {p["name"]: p["containerPort"] for p in container(one(objs, "Deployment", "kv-pool-sg-prefill"))["ports"]}
    assert ports["bootstrap"] == opts.bootstrap_port and ports["http"] == cfg.port
    kv = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert kv["endpoint"] == f"tcp://*:{ports['kv-events']}" and kv["replay_endpoint"] == f"tcp://*:{ports['kv-replay']}"
    _, _, dopts, dspec = _worker_engine(objs, "kv-pool-sg-decode", tmp_path)
    assert dspec.argv[dspec.argv.index("--disaggregation-mode") + 1] == "decode" and dopts.bootstrap_port is None
    for pool, role in (("kv-pool-trt-ctx", "prefill"), ("kv-pool-trt-gen", "decode")):
        backend, cfg, opts, spec = _worker_engine(objs, pool, tmp_path)
        assert backend.name == "trtllm" and spec.argv[0] == "trtllm-serve" and spec.argv[1] == "/models/llama-3.1-8b-engine"
        assert spec.argv.count("--extra_llm_api_options") == 1
        options = yaml.safe_load(next(iter(spec.files.values())))
        assert options["cache_transceiver_config"] == {"backend": "NIXL"} and options["return_perf_metrics"] is True
        assert options["kv_cache_config"]["tokens_per_block"] == cfg.block_size and opts.role.value == role
        if pool == "kv-pool-trt-ctx":  # the pool's engineConfig wins where it sets a key
            assert options["kv_cache_config"]["event_buffer_max_size"] == 1024


def test_service_monitor_reads_trtllm_engines_prometheus_path(rendered: dict[str, list[dict]]) -> None:
    (sm,) = find(rendered["all-backends"], "ServiceMonitor")
    http = next(e for e in sm["spec"]["endpoints"] if e["port"] == "http")
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_kvyard_io_backend"], "regex": "trtllm",
            "targetLabel": "__metrics_path__", "replacement": "/prometheus/metrics"} in http["relabelings"]


def test_workers_log_level_and_pool_env(rendered: dict[str, list[dict]]) -> None:
    for dep in find(rendered["sim-only"], "Deployment"):
        if dep["metadata"]["labels"]["app.kubernetes.io/component"] == "worker":
            env = env_of(container(dep))
            assert env["KVYARD_LOG_LEVEL"]["value"] == "info"
            assert env["KVYARD_POOL"]["value"] == dep["metadata"]["labels"]["kvyard.io/pool"]


# ---- monitoring -----------------------------------------------------------------------------------


def test_service_monitor_only_when_enabled(rendered: dict[str, list[dict]]) -> None:
    assert not find(rendered["default"], "ServiceMonitor")
    (sm,) = find(rendered["vllm-disagg-gpu"], "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["http", "metrics"]
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    targets = {r["targetLabel"] for r in sm["spec"]["endpoints"][0]["relabelings"]}
    assert {"pool", "role", "component"} <= targets
    # every Service it selects names its metrics port http or metrics
    for svc in find(rendered["vllm-disagg-gpu"], "Service"):
        if svc["metadata"]["labels"]["app.kubernetes.io/component"] in ("frontend", "planner", "worker"):
            assert {"http", "metrics"} & {p["name"] for p in svc["spec"]["ports"]}, svc["metadata"]["name"]


def _exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_grafana_dashboard_configmap(rendered: dict[str, list[dict]]) -> None:
    cm = one(rendered["default"], "ConfigMap", "demo-kvyard-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["kvyard.json"])
    assert dash == json.loads(DASHBOARD.read_text())  # .Files.Get of deploy/grafana/kvyard.json, unchanged
    assert (CHART / "dashboards" / "kvyard.json").resolve() == DASHBOARD.resolve()
    assert one(rendered["all-backends"], "ConfigMap", "kv-dashboard")["metadata"]["annotations"] == {"grafana_folder": "kvyard"}
    assert not find(rendered["external-redis-url"], "ConfigMap", "demo-kvyard-dashboard")


def test_dashboard_panels_use_real_metric_names() -> None:
    from orchestrator.metrics import FrontendMetrics
    from planner.metrics import PlannerMetrics

    dash = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"] for p in dash["panels"]).lower()
    for needed in ("time to first token", "inter-token latency", "tokens/s", "replicas per pool", "kv cache hit rate",
                   "prefill vs decode", "engines by role", "replicas by role"):
        assert needed in titles, needed
    exported = set()
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    for registry in (FrontendMetrics().registry, PlannerMetrics().registry):
        for family in registry.collect():
            exported.update(family.name + suffix for suffix in suffixes[family.type])
    exprs = " ".join(_exprs(dash))
    used = set(re.findall(r"\b(kvyard_[a-z_]+|vllm:[a-z_]+)", exprs))
    assert not ASSUMED_TARGET_METRICS & exported, "the planner exports a target gauge now: move it out of ASSUMED_TARGET_METRICS"
    unknown = used - exported - ASSUMED_TARGET_METRICS - ENGINE_METRICS
    assert not unknown, f"dashboard uses metrics nobody exports: {sorted(unknown)}"
    frontend_used = {m for m in used if m.startswith("kvyard_") and not m.startswith("kvyard_planner_")}
    assert {"kvyard_time_to_first_token_seconds_bucket", "kvyard_inter_token_latency_seconds_bucket",
            "kvyard_output_sequence_tokens_sum", "kvyard_requests_total"} <= frontend_used
    assert ASSUMED_TARGET_METRICS <= used
    assert {"kvyard_planner_current_replicas", "kvyard_planner_desired_replicas", "kvyard_planner_ticks_total"} <= used
    # every panel has a datasource and unique id; the JSON is what the generator writes
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    proc = subprocess.run([sys.executable, str(REPO / "deploy" / "grafana" / "make_dashboard.py")], capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout) == dash, "deploy/grafana/kvyard.json is stale: rerun deploy/grafana/make_dashboard.py"


# ---- values.yaml documents every value ------------------------------------------------------------


def test_every_value_is_documented() -> None:
    """Each key in values.yaml has a comment right above it, sits under a commented parent, or follows a
    commented one-line sibling (one comment for `nodeSelector: {}`, `tolerations: []`, `affinity: {}`)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    parents: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    undocumented = []
    prev_comment = False
    prev_key: tuple[int, bool, bool] | None = None  # (indent, documented, one-line) of the key just above
    for raw in lines:
        stripped = raw.strip()
        if not stripped:
            prev_comment, prev_key = False, None
            continue
        if stripped.startswith("#"):
            prev_comment = True
            continue
        m = re.match(r"^(\s*)(- )?([A-Za-z_][\w./-]*):(.*)$", raw)
        if m is None or m.group(2):  # list items belong to their documented list key
            prev_comment, prev_key = False, None
            continue
        indent, one_line = len(m.group(1)), bool(m.group(4).strip())
        while parents and parents[-1][0] >= indent:
            parents.pop()
        grouped = prev_key is not None and prev_key[0] == indent and prev_key[1] and prev_key[2] and one_line
        documented = prev_comment or grouped or any(doc for _, doc in parents)
        if not documented:
            undocumented.append(m.group(3))
        parents.append((indent, documented))
        prev_comment, prev_key = False, (indent, documented, one_line)
    assert not undocumented, f"values.yaml keys without a comment: {undocumented}"
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(_load(CHART / "values.yaml")) <= set(schema["properties"])


# ---- the images the chart runs --------------------------------------------------------------------


def test_dockerfiles_match_the_chart() -> None:
    """The Dockerfiles cannot be built here (no Docker engine); check what the chart relies on."""
    import tomllib

    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    top_level = {p.rstrip("*") for p in packages}
    values = _load(CHART / "values.yaml")
    for name in ("Dockerfile", "Dockerfile.vllm"):
        text = (REPO / "deploy" / name).read_text()
        assert "no Docker engine" in text
        assert 'ENTRYPOINT ["kvyard"]' in text  # the chart's `command: ["kvyard"]` is also on PATH
        copied = set(re.findall(r"^COPY (\w+) ", text, re.M))
        assert copied == top_level, f"{name} copies {sorted(copied)}, the distribution has {sorted(top_level)}"
        assert "pip install" in text or "pip wheel" in text
    uid = values["frontend"]["podSecurityContext"]["runAsUser"]
    assert f"USER {uid}:{uid}" in (REPO / "deploy" / "Dockerfile").read_text()
    assert values["planner"]["podSecurityContext"]["runAsUser"] == uid
    assert values["backends"]["vllm"]["enginePython"] == "python3"


def test_example_configs_load_with_the_real_config_classes() -> None:
    from orchestrator.config import ClusterConfig, FrontendConfig, load_yaml

    frontend = load_yaml(REPO / "deploy" / "examples" / "frontend.yaml")["frontend"]
    FrontendConfig(**frontend)  # every model forbids unknown keys: a misspelt one raises
    ClusterConfig(**load_yaml(REPO / "deploy" / "examples" / "local-sim.yaml"))
