{{/*
Names, labels, images and the values every kvyard container shares.
*/}}

{{- define "kvyard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Resource-name prefix; at most 40 characters so "<fullname>-pool-<pool>" fits in 63. */}}
{{- define "kvyard.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvyard.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every resource. Call with (dict "root" $ "component" "frontend"). */}}
{{- define "kvyard.labels" -}}
helm.sh/chart: {{ include "kvyard.chart" .root }}
{{ include "kvyard.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kvyard
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels. Call with (dict "root" $ "component" "frontend"). */}}
{{- define "kvyard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvyard.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* An image reference from {repository, tag}; the tag defaults to the chart's appVersion. */}}
{{- define "kvyard.imageRef" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- end }}

{{- define "kvyard.image" -}}
{{- include "kvyard.imageRef" (dict "root" . "image" .Values.image) }}
{{- end }}

{{- define "kvyard.plannerServiceAccount" -}}
{{- default (printf "%s-planner" (include "kvyard.fullname" .)) .Values.planner.serviceAccount.name }}
{{- end }}

{{- define "kvyard.authSecret" -}}
{{- default (printf "%s-auth" (include "kvyard.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* "true" when the frontend must require API keys (a key file is mounted), else "". */}}
{{- define "kvyard.apiKeysRequired" -}}
{{- if or .Values.auth.apiKeysRequired .Values.auth.apiKeys }}true{{ end }}
{{- end }}

{{/* A probe, switched to HTTPS when the frontend serves TLS (kubelet does not verify the certificate). */}}
{{- define "kvyard.frontendProbe" -}}
{{- $probe := deepCopy .probe }}
{{- if and .root.Values.tls.enabled $probe.httpGet }}
{{- $_ := set $probe.httpGet "scheme" "HTTPS" }}
{{- end }}
{{- toYaml $probe }}
{{- end }}

{{- define "kvyard.redisHost" -}}
{{- printf "%s-redis" (include "kvyard.fullname" .) }}
{{- end }}

{{/* The Secret holding the bundled Redis password, and its key. */}}
{{- define "kvyard.redisAuthSecret" -}}
{{- default (printf "%s-redis-auth" (include "kvyard.fullname" .)) .Values.redis.auth.existingSecret }}
{{- end }}

{{- define "kvyard.redisAuthKey" -}}
{{- if .Values.redis.auth.existingSecret }}{{ .Values.redis.auth.existingSecretKey }}{{ else }}redis-password{{ end }}
{{- end }}

{{/* The registry signing secret's Secret and key; "" when entries are not signed. */}}
{{- define "kvyard.registrySecret" -}}
{{- if .Values.registry.existingSecret }}{{ .Values.registry.existingSecret }}{{ else if .Values.registry.signingSecret }}{{ printf "%s-registry" (include "kvyard.fullname" .) }}{{ end }}
{{- end }}

{{/* The KVYARD_REDIS_URL env var: built for the bundled Redis (its password from its Secret, expanded by the
kubelet: the password appears in no manifest), a Secret reference otherwise. */}}
{{- define "kvyard.redisEnv" -}}
{{- if and .Values.redis.bundled .Values.redis.auth.enabled }}
- name: KVYARD_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvyard.redisAuthSecret" . }}
      key: {{ include "kvyard.redisAuthKey" . }}
{{- end }}
- name: KVYARD_REDIS_URL
{{- if .Values.redis.bundled }}
  value: {{ printf "redis://%s%s:%d/%d" (ternary ":$(KVYARD_REDIS_PASSWORD)@" "" .Values.redis.auth.enabled) (include "kvyard.redisHost" .) (int .Values.redis.port) (int .Values.redis.database) | quote }}
{{- else if .Values.redis.external.existingSecret }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- else }}
  valueFrom:
    secretKeyRef:
      name: {{ include "kvyard.fullname" . }}-redis-url
      key: redis-url
{{- end }}
{{- end }}

{{/* Environment every kvyard process gets. */}}
{{- define "kvyard.commonEnv" -}}
- name: KVYARD_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: HOME
  value: /tmp
{{ include "kvyard.redisEnv" . }}
{{- with include "kvyard.registrySecret" . }}
- name: KVYARD_REGISTRY_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ if $.Values.registry.existingSecret }}{{ $.Values.registry.existingSecretKey }}{{ else }}registry-secret{{ end }}
{{- end }}
{{- end }}

{{/* Pool Deployment name. Call with (dict "root" $ "pool" $pool). */}}
{{- define "kvyard.poolFullname" -}}
{{- printf "%s-pool-%s" (include "kvyard.fullname" .root) .pool.name }}
{{- end }}

{{/*
Pools with poolDefaults filled in, as YAML ({"pools": [...]}): a key the pool sets wins whole, a key
it leaves out comes from poolDefaults, image/enginePython from backends.<backend>. Also enforces the
rules the schema cannot express, failing with a "kvyard:" message.
*/}}
{{- define "kvyard.pools" -}}
{{- $root := . }}
{{- $out := list }}
{{- $seen := dict }}
{{- $roles := dict }}
{{- range $i, $p := .Values.pools }}
{{- $pool := deepCopy $root.Values.poolDefaults }}
{{- range $k, $v := $p }}
{{- $_ := set $pool $k $v }}
{{- end }}
{{- $be := get $root.Values.backends $pool.backend }}
{{- if not (hasKey $p "image") }}
{{- $img := deepCopy $be.image }}
{{- if not $img.repository }}{{ $img = deepCopy $root.Values.image }}{{ end }}
{{- $_ := set $pool "image" $img }}
{{- end }}
{{- if not (hasKey $p "enginePython") }}{{ $_ := set $pool "enginePython" $be.enginePython }}{{ end }}
{{- if not (hasKey $p "servedModelName") }}{{ $_ := set $pool "servedModelName" $pool.model }}{{ end }}
{{- if not (hasKey $p "role") }}{{ $_ := set $pool "role" "both" }}{{ end }}
{{- if not (hasKey $p "replicas") }}{{ $_ := set $pool "replicas" 1 }}{{ end }}
{{- if not (hasKey $p "pd") }}{{ $_ := set $pool "pd" dict }}{{ end }}
{{- $targets := deepCopy $root.Values.planner.targets }}
{{- range $k, $v := (default dict $p.targets) }}{{ $_ := set $targets $k $v }}{{ end }}
{{- $_ := set $pool "targets" $targets }}
{{- if hasKey $seen $pool.name }}
{{- fail (printf "kvyard: pools[%d]: pool name %q is used twice; pool names must be unique" $i $pool.name) }}
{{- end }}
{{- $_ := set $seen $pool.name true }}
{{- $fn := include "kvyard.poolFullname" (dict "root" $root "pool" $pool) }}
{{- if gt (len $fn) 63 }}
{{- fail (printf "kvyard: pools[%d]: resource name %q is %d characters; shorten the pool name or fullnameOverride (limit 63)" $i $fn (len $fn)) }}
{{- end }}
{{- $r := int $pool.replicas }}
{{- if and (hasKey $pool "minReplicas") (lt $r (int $pool.minReplicas)) }}
{{- fail (printf "kvyard: pools[%d] (%s): replicas %d is below minReplicas %d" $i $pool.name $r (int $pool.minReplicas)) }}
{{- end }}
{{- if and (hasKey $pool "maxReplicas") (gt $r (int $pool.maxReplicas)) }}
{{- fail (printf "kvyard: pools[%d] (%s): replicas %d is above maxReplicas %d" $i $pool.name $r (int $pool.maxReplicas)) }}
{{- end }}
{{- if eq (int $pool.kvEvents.port) (int $pool.port) }}
{{- fail (printf "kvyard: pools[%d] (%s): kvEvents.port must differ from port %d" $i $pool.name (int $pool.port)) }}
{{- end }}
{{- if eq (add1 (int $pool.kvEvents.port)) (int $pool.port) }}
{{- fail (printf "kvyard: pools[%d] (%s): port %d collides with the KV replay port (kvEvents.port + 1)" $i $pool.name (int $pool.port)) }}
{{- end }}
{{- if and (ne $pool.role "both") (ne $pool.backend "sim") (not $pool.pd.connector) }}
{{- fail (printf "kvyard: pools[%d] (%s): a %s %s pool needs pd.connector (vllm: e.g. NixlConnector; sglang: mooncake or nixl; trtllm: DEFAULT, UCX, NIXL or MPI)" $i $pool.name $pool.backend $pool.role) }}
{{- end }}
{{- if and (hasKey $p "engineConfig") (ne $pool.backend "trtllm") }}
{{- fail (printf "kvyard: pools[%d] (%s): engineConfig is for trtllm pools only; pass engine flags in engineArgs" $i $pool.name) }}
{{- end }}
{{- $key := printf "%s|%s" $pool.servedModelName $pool.role }}
{{- if hasKey $roles $key }}
{{- fail (printf "kvyard: pools[%d] (%s): pool %s already serves %q as %s; the planner keys pools by (served model, role), so merge them or change servedModelName" $i $pool.name (get $roles $key) $pool.servedModelName $pool.role) }}
{{- end }}
{{- $_ := set $roles $key $pool.name }}
{{- $out = append $out $pool }}
{{- end }}
{{- range $out }}
{{- if and (eq .role "prefill") (not (hasKey $roles (printf "%s|decode" .servedModelName))) }}
{{- fail (printf "kvyard: pool %s serves %q as prefill, but no decode pool serves that model; add one (role: decode)" .name .servedModelName) }}
{{- end }}
{{- if and (eq .role "decode") (not (hasKey $roles (printf "%s|prefill" .servedModelName))) }}
{{- fail (printf "kvyard: pool %s serves %q as decode, but no prefill pool serves that model; add one (role: prefill)" .name .servedModelName) }}
{{- end }}
{{- end }}
{{- toYaml (dict "pools" $out) }}
{{- end }}

{{/* Cross-field checks outside the pools. Included once by NOTES-independent templates. */}}
{{- define "kvyard.validate" -}}
{{- if and (not .Values.redis.bundled) (not .Values.redis.external.url) (not .Values.redis.external.existingSecret) }}
{{- fail "kvyard: redis.bundled is false, so set redis.external.url (redis://host:6379/0) or redis.external.existingSecret" }}
{{- end }}
{{- if and .Values.redis.bundled (or .Values.redis.external.url .Values.redis.external.existingSecret) }}
{{- fail "kvyard: redis.external is set but redis.bundled is true; set redis.bundled: false to use the external Redis" }}
{{- end }}
{{- if and .Values.auth.existingSecret (or .Values.auth.apiKeys .Values.auth.adminToken) }}
{{- fail "kvyard: auth.existingSecret is set, so auth.apiKeys and auth.adminToken must be empty (put them in that Secret)" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) }}
{{- fail "kvyard: tls.enabled needs tls.existingSecret (a kubernetes.io/tls Secret with tls.crt and tls.key)" }}
{{- end }}
{{- if eq (int .Values.frontend.httpPort) (int .Values.frontend.grpc.port) }}
{{- fail "kvyard: frontend.httpPort and frontend.grpc.port must differ" }}
{{- end }}
{{- if and .Values.redis.bundled .Values.redis.auth.enabled (not .Values.redis.auth.password) (not .Values.redis.auth.existingSecret) }}
{{- fail "kvyard: the bundled Redis needs a password: set redis.auth.password (16+ URL-safe characters, e.g. `openssl rand -hex 24`) or redis.auth.existingSecret" }}
{{- end }}
{{- end }}
