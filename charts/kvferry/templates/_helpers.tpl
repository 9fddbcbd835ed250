{{- define "kvferry.fullname" -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvferry.labels" -}}
app.kubernetes.io/name: kvferry-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: kvferry
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvferry.selector" -}}
app.kubernetes.io/name: kvferry-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvferry.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvferry.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvferry.image" -}}
{{- printf "%s/kvferry-operator:%s" .Values.image.registry (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The kinds the operator manages, and no more. */}}
{{- define "kvferry.rules" -}}
- apiGroups: ["kvferry.dev"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["kvferry.dev"]
  resources: ["inferencepools/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: [""]
  resources: ["configmaps", "services", "serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# the pool secret: created once with a random token, never read back (the pods mount it)
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# spec.monitoring (the Prometheus Operator's kinds; harmless where its CRDs are not installed).
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors", "servicemonitors", "prometheusrules"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
{{- end -}}
