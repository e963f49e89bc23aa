{{/*
Chart name.
*/}}
{{- define "sandbox-gateway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: <release>-<chart>, or the release name when it already contains the chart name.
*/}}
{{- define "sandbox-gateway.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "sandbox-gateway.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels on every resource.
*/}}
{{- define "sandbox-gateway.labels" -}}
helm.sh/chart: {{ include "sandbox-gateway.chart" . }}
{{ include "sandbox-gateway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sandbox-gateway
{{- end }}

{{/*
Selector labels: the gateway pods (Deployment selector, Service, NetworkPolicies, PDB, spread).
*/}}
{{- define "sandbox-gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sandbox-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "sandbox-gateway.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sandbox-gateway.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "sandbox-gateway.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/* Secret names. */}}
{{- define "sandbox-gateway.caSecretName" -}}
{{- .Values.ca.existingSecret | default (printf "%s-ca" (include "sandbox-gateway.fullname" .)) }}
{{- end }}
{{- define "sandbox-gateway.signingSecretName" -}}
{{- .Values.signing.existingSecret | default (printf "%s-signing" (include "sandbox-gateway.fullname" .)) }}
{{- end }}
{{- define "sandbox-gateway.adminSecretName" -}}
{{- .Values.adminToken.existingSecret | default (printf "%s-admin" (include "sandbox-gateway.fullname" .)) }}
{{- end }}
{{- define "sandbox-gateway.adminSecretKey" -}}
{{- if .Values.adminToken.existingSecret }}{{ .Values.adminToken.existingSecretKey }}{{ else }}token{{ end }}
{{- end }}

{{/* Paths inside the gateway container. */}}
{{- define "sandbox-gateway.gitRoot" -}}/git{{- end }}
{{- /* Scratch files (mitmproxy's confdir, metrics of the worker processes): an emptyDir, never the state volume. */}}
{{- define "sandbox-gateway.runtimeDir" -}}/run/sandbox-gateway{{- end }}
{{- /* The state volume (state.store: sqlite) and the file on it. */}}
{{- define "sandbox-gateway.stateDir" -}}
{{- .Values.persistence.mountPath | trimSuffix "/" }}
{{- end }}
{{- define "sandbox-gateway.statePath" -}}
{{- printf "%s/gateway.db" (include "sandbox-gateway.stateDir" .) }}
{{- end }}
{{- define "sandbox-gateway.stateClaimName" -}}
{{- .Values.persistence.existingClaim | default (printf "%s-state" (include "sandbox-gateway.fullname" .)) }}
{{- end }}
{{- define "sandbox-gateway.policiesDir" -}}
{{- if .Values.gitSync.enabled }}
{{- printf "%s/current/%s" (include "sandbox-gateway.gitRoot" .) (.Values.gitSync.path | trimPrefix "/" | trimSuffix "/") | trimSuffix "/" }}
{{- else }}
{{- "/etc/sandbox-gateway/policies" }}
{{- end }}
{{- end }}

{{/*
Policy files from values (every key ending in .yaml/.yml), as a dict file name -> text.
*/}}
{{- define "sandbox-gateway.policyFiles" -}}
{{- $files := dict }}
{{- range $k, $v := .Values.policies }}
{{- if or (hasSuffix ".yaml" $k) (hasSuffix ".yml" $k) }}
{{- $_ := set $files $k $v }}
{{- end }}
{{- end }}
{{- toYaml $files }}
{{- end }}

{{/*
Generated key material, computed once per render and shared by the Secret templates and the checksum
annotations (so the checksum matches what is stored). Reuses what the cluster already holds (lookup), so
upgrades keep the CA, the signing keys and the admin token. Under `helm template` / `--dry-run` lookup is
empty and fresh material is generated on every render: use the existingSecret values with GitOps tools.
Returns YAML: {ca: {tls.crt, tls.key}, signing: {<kid>.pem: ...}, admin: {token: ...}} (base64 values).
*/}}
{{- define "sandbox-gateway.generated" -}}
{{- $cache := .Values }}
{{- if not (hasKey $cache "__sandboxGatewayGenerated") }}
{{- $out := dict "ca" (dict) "signing" (dict) "admin" (dict) }}
{{- $ns := .Release.Namespace }}
{{- if not .Values.ca.existingSecret }}
{{- $existing := lookup "v1" "Secret" $ns (include "sandbox-gateway.caSecretName" .) }}
{{- if and $existing $existing.data (index $existing.data "tls.crt") (index $existing.data "tls.key") }}
{{- $_ := set $out "ca" (dict "tls.crt" (index $existing.data "tls.crt") "tls.key" (index $existing.data "tls.key")) }}
{{- else }}
{{- /* ECDSA P-256, like `sandbox-gateway ca init`: leaf signing is much cheaper than with RSA. */}}
{{- $ca := genCAWithKey .Values.ca.commonName (int .Values.ca.validityDays) (genPrivateKey "ecdsa") }}
{{- $_ := set $out "ca" (dict "tls.crt" ($ca.Cert | b64enc) "tls.key" ($ca.Key | b64enc)) }}
{{- end }}
{{- end }}
{{- if not .Values.signing.existingSecret }}
{{- $existing := lookup "v1" "Secret" $ns (include "sandbox-gateway.signingSecretName" .) }}
{{- $old := dict }}
{{- if and $existing $existing.data }}{{ $old = $existing.data }}{{ end }}
{{- $keys := dict }}
{{- range $kid := .Values.signing.kids }}
{{- $entry := printf "%s.pem" $kid }}
{{- if hasKey $old $entry }}
{{- $_ := set $keys $entry (index $old $entry) }}
{{- else }}
{{- $_ := set $keys $entry (genPrivateKey "ed25519" | b64enc) }}
{{- end }}
{{- end }}
{{- $_ := set $out "signing" $keys }}
{{- end }}
{{- if not .Values.adminToken.existingSecret }}
{{- $existing := lookup "v1" "Secret" $ns (include "sandbox-gateway.adminSecretName" .) }}
{{- if and $existing $existing.data (index $existing.data "token") }}
{{- $_ := set $out "admin" (dict "token" (index $existing.data "token")) }}
{{- else }}
{{- $_ := set $out "admin" (dict "token" (randAlphaNum 48 | b64enc)) }}
{{- end }}
{{- end }}
{{- $_ := set $cache "__sandboxGatewayGenerated" $out }}
{{- end }}
{{- toYaml (index $cache "__sandboxGatewayGenerated") }}
{{- end }}

{{/*
gateway.yaml as a dict (rendered by configmap-config.yaml, hashed by the Deployment).
*/}}
{{- define "sandbox-gateway.config" -}}
{{- $listen := dict "proxy" (printf "0.0.0.0:%d" (int .Values.ports.proxy)) "admin" (printf "0.0.0.0:%d" (int .Values.ports.admin)) "transparent" nil "dns" nil }}
{{- if .Values.transparent.enabled }}
{{- $_ := set $listen "transparent" (printf "0.0.0.0:%d" (int .Values.transparent.port)) }}
{{- end }}
{{- if include "sandbox-gateway.dnsEnabled" . }}
{{- $_ := set $listen "dns" (printf "0.0.0.0:%d" (int .Values.transparent.dns.containerPort)) }}
{{- end }}
{{- if .Values.networkPolicy.enabled }}
{{- $_ := set $listen "reachable_from" (printf "NetworkPolicy %s: the proxy port from the pods of %s only" (include "sandbox-gateway.fullname" .) (join ", " .Values.networkPolicy.sandboxNamespaces | default "no namespace yet (networkPolicy.sandboxNamespaces)")) }}
{{- end }}
{{- $secrets := dict "store" .Values.secretStore.store }}
{{- if eq .Values.secretStore.store "azure-keyvault" }}
{{- $_ := set $secrets "vault_url" .Values.secretStore.vaultUrl }}
{{- $_ := set $secrets "credential" .Values.secretStore.credential }}
{{- with .Values.secretStore.clientId }}
{{- $_ := set $secrets "client_id" . }}
{{- end }}
{{- else if eq .Values.secretStore.store "file" }}
{{- $_ := set $secrets "path" "/etc/sandbox-gateway/secrets/secrets.yaml" }}
{{- end }}
{{- with .Values.secretStore.cache }}
{{- $_ := set $secrets "cache" . }}
{{- end }}
{{- $state := dict "store" .Values.state.store }}
{{- if eq .Values.state.store "sqlite" }}
{{- $_ := set $state "path" (include "sandbox-gateway.statePath" .) }}
{{- end }}
{{- if and (eq .Values.state.store "redis") .Values.state.redis.url (not .Values.state.redis.existingSecret) }}
{{- $_ := set $state "url" .Values.state.redis.url }}
{{- end }}
{{- $cfg := dict
  "listen" $listen
  "admin_token" nil
  "policies" (include "sandbox-gateway.policiesDir" .)
  "certs" "/etc/sandbox-gateway/certs"
  "tokens" .Values.config.tokens
  "secrets" $secrets
  "network" .Values.config.network
  "refusals" .Values.config.refusals
  "audit" .Values.config.audit
  "console" .Values.config.console
  "state" $state
  "runtime_dir" (include "sandbox-gateway.runtimeDir" .)
  "log_level" .Values.config.log_level
  "workers" (int .Values.config.workers)
  "shutdown" (dict "drain" (printf "%ds" (int .Values.shutdown.drainSeconds)))
}}
{{- /* The memory ceiling: a share of the container's memory limit, so only with one. */}}
{{- if and .Values.config.limits.memory (.Values.resources.limits | default dict).memory }}
{{- $_ := set $cfg "limits" (dict "memory" .Values.config.limits.memory) }}
{{- end }}
{{- if include "sandbox-gateway.dnsEnabled" . }}
{{- $_ := set $cfg "dns" (dict "ttl" .Values.transparent.dns.ttl "rate" .Values.transparent.dns.rate "burst" (int .Values.transparent.dns.burst)) }}
{{- end }}
{{- $k8s := .Values.identity.kubernetes }}
{{- if $k8s.enabled }}
{{- $ex := $k8s.exchange }}
{{- $exchange := dict "enabled" $ex.enabled "audience" $ex.audience "verify" $ex.verify "issuer" nil "ttl" $ex.ttl }}
{{- with $ex.issuer }}
{{- $_ := set $exchange "issuer" . }}
{{- end }}
{{- $kube := dict
  "enabled" true
  "kubeconfig" nil
  "namespaces" $k8s.namespaces
  "policy_label" $k8s.policy_label
  "default_policies" ($k8s.default_policies | default dict)
  "pod_selector" $k8s.pod_selector
  "stale_after" $k8s.stale_after
  "exchange" $exchange
}}
{{- with $k8s.kubeconfig }}
{{- $_ := set $kube "kubeconfig" . }}
{{- end }}
{{- $_ := set $cfg "identity" (dict "kubernetes" $kube) }}
{{- end }}
{{- toYaml (merge (deepCopy $cfg) (deepCopy .Values.config.extra)) }}
{{- end }}

{{/* "true" when the gateway runs its DNS resolver (transparent mode with transparent.dns.enabled), else empty. */}}
{{- define "sandbox-gateway.dnsEnabled" -}}
{{- if and .Values.transparent.enabled .Values.transparent.dns.enabled }}true{{ end }}
{{- end }}

{{/* The policy name `helm test` mints a token for. */}}
{{- define "sandbox-gateway.testPolicy" -}}
{{- if .Values.test.policy }}
{{- .Values.test.policy }}
{{- else if not .Values.gitSync.enabled }}
{{- $files := include "sandbox-gateway.policyFiles" . | fromYaml }}
{{- if $files }}
{{- keys $files | sortAlpha | first | trimSuffix ".yaml" | trimSuffix ".yml" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
git-sync container body (shared by the init container and the sidecar). Args: dict root=<top context> oneTime=<bool>.
*/}}
{{- define "sandbox-gateway.gitSyncContainer" -}}
{{- $v := .root.Values.gitSync -}}
image: {{ printf "%s:%s" $v.image.repository $v.image.tag }}
imagePullPolicy: {{ $v.image.pullPolicy }}
env:
  - name: GITSYNC_REPO
    value: {{ $v.repo | quote }}
  - name: GITSYNC_REF
    value: {{ $v.ref | quote }}
  - name: GITSYNC_DEPTH
    value: {{ $v.depth | quote }}
  - name: GITSYNC_ROOT
    value: {{ include "sandbox-gateway.gitRoot" .root | quote }}
  - name: GITSYNC_LINK
    value: "current"
  {{- if .oneTime }}
  - name: GITSYNC_ONE_TIME
    value: "true"
  {{- else }}
  - name: GITSYNC_PERIOD
    value: {{ $v.period | quote }}
  {{- end }}
  - name: HOME
    value: /tmp
  {{- with $v.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with $v.credentialsSecret }}
envFrom:
  - secretRef:
      name: {{ . }}
{{- end }}
resources:
  {{- toYaml $v.resources | nindent 2 }}
securityContext:
  {{- toYaml $v.securityContext | nindent 2 }}
volumeMounts:
  - name: git
    mountPath: {{ include "sandbox-gateway.gitRoot" .root }}
  - name: git-tmp
    mountPath: /tmp
{{- end }}

{{/*
An egress rule to the host and port of a URL, when the address can be told at render time:
an IPv4 address (an ipBlock /32), or a Service name (`svc`, `svc.<ns>.svc`,
`svc.<ns>.svc.cluster.local`: every pod of that namespace on the URL's port, the port the
pods serve when the Service's targetPort is the same). Empty when it cannot.
Arguments: dict "url" "port" (the scheme's default) "namespace" (the release's).
*/}}
{{- define "sandbox-gateway.urlEgress" -}}
{{- $hostport := (urlParse .url).host }}
{{- $host := regexReplaceAll ":[0-9]+$" $hostport "" | lower }}
{{- $port := int .port }}
{{- if regexMatch ":[0-9]+$" $hostport }}{{ $port = regexFind "[0-9]+$" $hostport | int }}{{ end }}
{{- $ports := list (dict "port" $port "protocol" "TCP") }}
{{- if regexMatch "^[0-9]{1,3}(\\.[0-9]{1,3}){3}$" $host }}
{{- dict "to" (list (dict "ipBlock" (dict "cidr" (printf "%s/32" $host)))) "ports" $ports "where" (printf "%s:%d" $host $port) | toYaml }}
{{- else }}
{{- $ns := "" }}
{{- if regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" $host }}
{{- $ns = .namespace }}
{{- else if regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?\\.svc(\\.cluster\\.local)?$" $host }}
{{- $ns = index (splitList "." $host) 1 }}
{{- end }}
{{- if $ns }}
{{- $peer := dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" $ns)) "podSelector" dict }}
{{- dict "to" (list $peer) "ports" $ports "where" (printf "%s:%d (the pods of namespace %s)" $host $port $ns) | toYaml }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The gateway's egress to its own dependencies, derived from values (or given in
networkPolicy.gateway.egressTo), as YAML {rules: [...], opened: [...]}: `rules` go into the
gateway NetworkPolicy, `opened` into NOTES. Fails, with the reason, when a dependency's
address cannot be told and nothing else lets the gateway reach it.
*/}}
{{- define "sandbox-gateway.dependencyEgress" -}}
{{- $np := .Values.networkPolicy }}
{{- $to := $np.gateway.egressTo | default dict }}
{{- $internet := $np.gateway.allowInternet }}
{{- $rules := list }}
{{- $opened := list }}
{{- if and (eq .Values.state.store "redis") (or .Values.state.redis.url .Values.state.redis.existingSecret) }}
{{- $url := .Values.state.redis.url }}
{{- $derived := "" }}
{{- if $url }}{{ $derived = include "sandbox-gateway.urlEgress" (dict "url" $url "port" 6379 "namespace" .Release.Namespace) }}{{ end }}
{{- if $to.redis }}
{{- $rules = concat $rules $to.redis }}
{{- $opened = append $opened "Redis (state.store: redis): the rules of networkPolicy.gateway.egressTo.redis" }}
{{- else if $derived }}
{{- $rule := fromYaml $derived }}
{{- $rules = append $rules (omit $rule "where") }}
{{- $opened = append $opened (printf "Redis (state.store: redis): TCP %s, from state.redis.url" $rule.where) }}
{{- else if and $url $internet }}
{{- $opened = append $opened (printf "Redis (state.store: redis): %s only through the internet rule (public addresses); a private address needs networkPolicy.gateway.egressTo.redis" (urlParse $url).host) }}
{{- else }}
{{- fail (printf "state.store: redis: the gateway's NetworkPolicy cannot tell where Redis is (%s), so the gateway could not reach it. Set networkPolicy.gateway.egressTo.redis (NetworkPolicyEgressRule objects: its address and port), or networkPolicy.enabled: false" (ternary "the URL is in state.redis.existingSecret" (printf "%s is not an IPv4 address or a <service>.<namespace>.svc name, and networkPolicy.gateway.allowInternet is off" (urlParse $url).host) (empty $url))) }}
{{- end }}
{{- end }}
{{- $proxy := .Values.config.network.upstream_proxy }}
{{- if $proxy }}
{{- $derived := "" }}
{{- $where := "the pod's HTTPS_PROXY (upstream_proxy: env)" }}
{{- if kindIs "map" $proxy }}
{{- $scheme := (urlParse $proxy.url).scheme }}
{{- $derived = include "sandbox-gateway.urlEgress" (dict "url" $proxy.url "port" (ternary 1080 (ternary 443 80 (eq $scheme "https")) (hasPrefix "socks" $scheme)) "namespace" .Release.Namespace) }}
{{- $where = (urlParse $proxy.url).host }}
{{- end }}
{{- if $to.upstreamProxy }}
{{- $rules = concat $rules $to.upstreamProxy }}
{{- $opened = append $opened "the upstream proxy (config.network.upstream_proxy): the rules of networkPolicy.gateway.egressTo.upstreamProxy" }}
{{- else if $derived }}
{{- $rule := fromYaml $derived }}
{{- $rules = append $rules (omit $rule "where") }}
{{- $opened = append $opened (printf "the upstream proxy (config.network.upstream_proxy): TCP %s, from its url" $rule.where) }}
{{- else }}
{{- fail (printf "config.network.upstream_proxy: the gateway's NetworkPolicy cannot tell where the proxy is (%s is not an IPv4 address or a <service>.<namespace>.svc name), and every upstream dial goes through it. Set networkPolicy.gateway.egressTo.upstreamProxy (NetworkPolicyEgressRule objects: its address and port), or networkPolicy.enabled: false" $where) }}
{{- end }}
{{- end }}
{{- if eq .Values.secretStore.store "azure-keyvault" }}
{{- if $to.keyVault }}
{{- $rules = concat $rules $to.keyVault }}
{{- $opened = append $opened (printf "Key Vault %s (a private endpoint): the rules of networkPolicy.gateway.egressTo.keyVault" .Values.secretStore.vaultUrl) }}
{{- else if $internet }}
{{- $opened = append $opened (printf "Key Vault %s and Entra ID sign-in: through the internet rule (public endpoints); a private endpoint needs networkPolicy.gateway.egressTo.keyVault" .Values.secretStore.vaultUrl) }}
{{- else }}
{{- fail "secretStore.store: azure-keyvault with networkPolicy.gateway.allowInternet off: the gateway could not reach the Key Vault (nor Entra ID to sign in). Set networkPolicy.gateway.egressTo.keyVault (the private endpoint's address, port 443, and Entra ID's), or allowInternet: true" }}
{{- end }}
{{- end }}
{{- if .Values.identity.kubernetes.enabled }}
{{- $api := list }}
{{- $endpoints := lookup "v1" "Endpoints" "default" "kubernetes" }}
{{- range ($endpoints.subsets | default list) }}
{{- $ports := list }}
{{- range .ports }}{{ $ports = append $ports (dict "port" .port "protocol" "TCP") }}{{ end }}
{{- $peers := list }}
{{- range .addresses }}{{ $peers = append $peers (dict "ipBlock" (dict "cidr" (printf "%s/32" .ip))) }}{{ end }}
{{- $api = append $api (dict "to" $peers "ports" $ports) }}
{{- end }}
{{- if $to.kubernetesApi }}
{{- $rules = concat $rules $to.kubernetesApi }}
{{- $opened = append $opened "the Kubernetes API (identity.kubernetes): the rules of networkPolicy.gateway.egressTo.kubernetesApi" }}
{{- else if $api }}
{{- $rules = concat $rules $api }}
{{- $opened = append $opened "the Kubernetes API (identity.kubernetes): the endpoints of Service default/kubernetes, read at install" }}
{{- else if $internet }}
{{- $opened = append $opened "the Kubernetes API (identity.kubernetes): only through the internet rule, if its endpoint is a public address (kubectl get endpoints kubernetes -n default); else set networkPolicy.gateway.egressTo.kubernetesApi" }}
{{- else }}
{{- fail "identity.kubernetes.enabled with networkPolicy.gateway.allowInternet off: the gateway could not reach the Kubernetes API, and its address is not known at render time (helm template reads no cluster). Set networkPolicy.gateway.egressTo.kubernetesApi (the endpoints of kubectl get endpoints kubernetes -n default)" }}
{{- end }}
{{- end }}
{{- dict "rules" $rules "opened" $opened | toYaml }}
{{- end }}
