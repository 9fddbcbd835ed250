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

{{/* What the operator calls, and no more (tests/operator/test_rbac.py holds it to the calls it makes).
Children are listed by label, written with server-side apply (create + patch) and pruned: never read one
by one, never watched. */}}
{{- define "kvferry.rules" -}}
# kopf: watches pools, patches their finalizer and progress annotations, and their status
- apiGroups: ["kvferry.dev"]
  resources: ["inferencepools"]
  verbs: ["list", "watch", "patch"]
- apiGroups: ["kvferry.dev"]
  resources: ["inferencepools/status"]
  verbs: ["patch"]
# children carry blockOwnerDeletion: where OwnerReferencesPermissionEnforcement is on (OpenShift) that
# needs update on the owner's finalizers
- apiGroups: ["kvferry.dev"]
  resources: ["inferencepools/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["configmaps", "services", "serviceaccounts"]
  verbs: ["list", "create", "patch", "delete"]
# the SLO autoscaler reads a pool's timing model (spec.autoscaling.slo.timingConfigMap)
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get"]
# the pool secret: created once with a random token, never read back (the pods mount it)
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
# the autoscaler lists and annotates pods; watch because the router's Role grants it, and Kubernetes
# lets only a holder of a permission grant it
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "patch"]
# kopf's events on the pool
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["list", "create", "patch", "delete"]
# spec.monitoring (the Prometheus Operator's kinds; harmless where its CRDs are not installed).
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors", "servicemonitors", "prometheusrules"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["list", "create", "patch", "delete"]
{{- end -}}
