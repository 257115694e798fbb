{{- define "kubestar.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kubestar.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kubestar.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kubestar.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kubestar.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kubestar.image" -}}
{{- printf "%s:%s" .Values.images.kubestar.repository (default .Chart.AppVersion .Values.images.kubestar.tag) -}}
{{- end -}}

{{/*
What the operator may do with the resources it reconciles and their children: one list of
rules, a ClusterRole when it watches every namespace (operator.clusterWide), else a Role in
each namespace it watches (and nothing beyond them).
*/}}
{{- define "kubestar.operatorRules" }}
- apiGroups: ["kubestar.dev"]
  resources: ["sandboxpools", "rolloutfleets", "trainingruns"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["kubestar.dev"]
  resources: ["sandboxpools/status", "rolloutfleets/status", "trainingruns/status"]
  verbs: ["get", "patch"]
# A fleet's spec.autoscaling: the operator sets its replicas as a HorizontalPodAutoscaler
# would, through the scale subresource (never the rest of the spec).
- apiGroups: ["kubestar.dev"]
  resources: ["rolloutfleets/scale"]
  verbs: ["get", "patch"]
# Owner references with blockOwnerDeletion need this where the admission plugin
# OwnerReferencesPermissionEnforcement is on.
- apiGroups: ["kubestar.dev"]
  resources: ["sandboxpools/finalizers", "rolloutfleets/finalizers", "trainingruns/finalizers"]
  verbs: ["update"]
- apiGroups: ["apps"]
  resources: ["deployments", "statefulsets"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["services", "configmaps", "serviceaccounts", "persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  # list: a child's FailedCreate events (pods refused by a quota or an admission policy).
  verbs: ["create", "patch", "list"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch"]
# Each resource's copy of the installation's token (a Secret it owns, beside its pods): what
# applying it takes, no list or watch.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "patch"]
{{- end }}

{{/*
The Secret that holds the installation's bearer token (key `token`).
*/}}
{{- define "kubestar.authSecretName" -}}
{{- default (printf "%s-auth" (include "kubestar.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/*
The namespaces the operator watches, as JSON: none with operator.clusterWide (every
namespace), else operator.watchNamespaces, else the release's own namespace.
*/}}
{{- define "kubestar.watchNamespaces" -}}
{{- if .Values.operator.clusterWide -}}
{{- if .Values.operator.watchNamespaces -}}
{{- fail "operator.clusterWide watches every namespace: leave operator.watchNamespaces empty, or set clusterWide false" -}}
{{- end -}}
{{- list | toJson -}}
{{- else -}}
{{- default (list .Release.Namespace) .Values.operator.watchNamespaces | toJson -}}
{{- end -}}
{{- end -}}
