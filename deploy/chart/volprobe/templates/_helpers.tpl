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

{{/* HTTPS when the web configuration turns TLS on (README: "on when a certificate, key or client auth is set"). */}}
{{- define "volprobe.scheme" -}}
{{- if .Values.webConfig.tls_server_config }}HTTPS{{ else }}HTTP{{ end }}
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
