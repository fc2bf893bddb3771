{{/* The chart's name, "volprobe" unless nameOverride: the pods' app.kubernetes.io/name, hence the job label. */}}
{{- define "volprobe.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The objects' name: the release's when it contains the chart's name (`helm install volprobe ...`). */}}
{{- define "volprobe.fullname" -}}
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

{{- define "volprobe.selectorLabels" -}}
app.kubernetes.io/name: {{ include "volprobe.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "volprobe.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "volprobe.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: volprobe
{{- end }}

{{- define "volprobe.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "volprobe.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "volprobe.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/* HTTPS when the web configuration turns TLS on (README: "on when a certificate, key or client auth is set").
webConfig may be {} or null. */}}
{{- define "volprobe.scheme" -}}
{{- if get (.Values.webConfig | default dict) "tls_server_config" }}HTTPS{{ else }}HTTP{{ end }}
{{- end }}

{{/* "true" when every client must show a certificate (client_auth_type RequireAndVerifyClientCert, or
RequireAnyClientCert and its old name RequireClientCert): the kubelet shows none, so its httpGet probes could not
complete the handshake, and the probes only open a TCP connection. VerifyClientCertIfGiven lets it through. */}}
{{- define "volprobe.clientCertRequired" -}}
{{- $tls := get (.Values.webConfig | default dict) "tls_server_config" | default dict }}
{{- if has (get $tls "client_auth_type" | default "" | toString) (list "RequireAndVerifyClientCert" "RequireAnyClientCert" "RequireClientCert") }}true{{ end }}
{{- end }}

{{/* The liveness or readiness probe's action: GET of a path (index . 0) on the metrics port, or, where client
certificates are required, a TCP connection to it. */}}
{{- define "volprobe.probeAction" -}}
{{- $path := index . 0 }}
{{- $root := index . 1 }}
{{- if include "volprobe.clientCertRequired" $root -}}
tcpSocket:
  port: {{ $root.Values.service.portName }}
{{- else -}}
httpGet:
  path: {{ $path }}
  port: {{ $root.Values.service.portName }}
  scheme: {{ include "volprobe.scheme" $root }}
{{- end }}
{{- end }}

{{/*
"true" when the container runs as root with SYS_ADMIN alone (daemonset.yaml): for the NVMe admin command of
awsNvmeStats, or for config.kubernetes.rules (writes in pod volumes, through private copies of their mounts).
The state directory's owner follows it (volprobe.stateOwner). volprobe itself keeps CAP_SYS_ADMIN alone then,
whatever the runtime gives a privileged container, and none otherwise (README, "Privileges").
*/}}
{{- define "volprobe.rootWithSysAdmin" -}}
{{- if or .Values.awsNvmeStats (dig "kubernetes" "rules" list (.Values.config | default dict)) }}true{{ end }}
{{- end }}

{{/*
"true" when the configuration opens the host's block devices, which only a privileged container may (its device
cgroup): awsNvmeStats (the NVMe admin command goes to the device), discovery (every whole disk, read), and any
target (a device's probes; a directory target's read probes read its disk where the container can open it). A
configuration of pod volumes alone (kubernetes: their mount checks, and kubernetes.rules' probes, which write
and read files in the volumes) opens none: the container is then not privileged.
*/}}
{{- define "volprobe.hostBlockDevices" -}}
{{- $config := .Values.config | default dict }}
{{- if or .Values.awsNvmeStats (get $config "discovery") (get $config "targets") }}true{{ end }}
{{- end }}

{{/* "UID:GID" of the user volprobe runs as, whom the init step gives the state directory: runAsUser and runAsGroup
of containerSecurityContext, else of securityContext (the pod's), else 65534 (nobody), as in the image; root's
when volprobe.rootWithSysAdmin. */}}
{{- define "volprobe.stateOwner" -}}
{{- $ids := dict "runAsUser" 65534 "runAsGroup" 65534 }}
{{- range list (.Values.securityContext | default dict) (.Values.containerSecurityContext | default dict) }}
{{- $context := . }}
{{- range $key := list "runAsUser" "runAsGroup" }}
{{- $id := get $context $key }}
{{- if or (kindIs "float64" $id) (kindIs "int64" $id) (kindIs "int" $id) }}
{{- $_ := set $ids $key $id }}
{{- end }}
{{- end }}
{{- end }}
{{- if include "volprobe.rootWithSysAdmin" . }}
{{- /* The container runs as root then (daemonset.yaml), without CAP_DAC_OVERRIDE: the directory must be root's. */}}
{{- $_ := set $ids "runAsUser" 0 }}
{{- end }}
{{- printf "%d:%d" (int64 $ids.runAsUser) (int64 $ids.runAsGroup) }}
{{- end }}

{{/* The affinity: the user's, with the exclusion of virtual nodes and EKS Fargate (no block devices of their
own, and no DaemonSet pods there) ANDed into each required nodeSelectorTerm, as the node-exporter chart does. */}}
{{- define "volprobe.affinity" -}}
{{- $exclude := list
  (dict "key" "eks.amazonaws.com/compute-type" "operator" "NotIn" "values" (list "fargate"))
  (dict "key" "type" "operator" "NotIn" "values" (list "virtual-kubelet")) }}
{{- $affinity := deepCopy (.Values.affinity | default dict) }}
{{- $nodeAffinity := get $affinity "nodeAffinity" | default dict }}
{{- $required := get $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution" | default dict }}
{{- $terms := list }}
{{- range (get $required "nodeSelectorTerms" | default (list dict)) }}
{{- $terms = append $terms (merge (dict "matchExpressions" (concat (get . "matchExpressions" | default list) $exclude)) .) }}
{{- end }}
{{- $_ := set $required "nodeSelectorTerms" $terms }}
{{- $_ := set $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution" $required }}
{{- $_ := set $affinity "nodeAffinity" $nodeAffinity }}
{{- toYaml $affinity }}
{{- end }}

{{/* The HTTP endpoint of a ServiceMonitor or PodMonitor, from its values. */}}
{{- define "volprobe.endpoint" -}}
{{- $values := index . 0 }}
{{- $root := index . 1 }}
port: {{ $root.Values.service.portName }}
path: /metrics
scheme: {{ include "volprobe.scheme" $root | lower }}
{{- with $values.interval }}
interval: {{ . }}
{{- end }}
{{- with $values.scrapeTimeout }}
scrapeTimeout: {{ . }}
{{- end }}
{{- with $values.basicAuth }}
basicAuth:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.tlsConfig }}
tlsConfig:
  {{- toYaml . | nindent 2 }}
{{- end }}
relabelings:
  - sourceLabels: [__meta_kubernetes_pod_node_name]
    targetLabel: instance
    action: replace
  - sourceLabels: [__meta_kubernetes_pod_node_name]
    targetLabel: node
    action: replace
  {{- with $values.relabelings }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with $values.metricRelabelings }}
metricRelabelings:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
