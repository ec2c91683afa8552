{{/* Names and labels shared by every template. */}}

{{- define "exitplan.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-<chart>, or the release name alone when it already holds the chart name. */}}
{{- define "exitplan.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "exitplan.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object the chart creates. */}}
{{- define "exitplan.labels" -}}
helm.sh/chart: {{ include "exitplan.chart" . }}
app.kubernetes.io/name: {{ include "exitplan.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: exitplan
{{- end -}}

{{/* Labels of the operator's pod template: the selector labels and what names the app, never the
     chart's version (a chart bump would otherwise restart the operator for nothing), then
     operator.podLabels (which cannot replace the selector labels). */}}
{{- define "exitplan.operatorPodLabels" -}}
{{- $labels := include "exitplan.operatorSelectorLabels" . | fromYaml -}}
{{- $_ := set $labels "app.kubernetes.io/managed-by" .Release.Service -}}
{{- $_ := set $labels "app.kubernetes.io/part-of" "exitplan" -}}
{{- toYaml (merge $labels (.Values.operator.podLabels | default dict)) -}}
{{- end -}}

{{/* Selector labels of the operator pods (stable across upgrades). */}}
{{- define "exitplan.operatorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "exitplan.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels the operator puts on the routers and workers it creates (operator/builders.py MANAGED
     and selector_labels): what the PodMonitor and the NetworkPolicies select. */}}
{{- define "exitplan.dataPlaneLabels" -}}
app.kubernetes.io/name: exitplan
app.kubernetes.io/managed-by: exitplan-operator
{{- end -}}

{{- define "exitplan.operatorName" -}}
{{- printf "%s-operator" (include "exitplan.fullname" .) -}}
{{- end -}}

{{- define "exitplan.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "exitplan.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The profiling Jobs' ServiceAccount: fixed by the operator (operator/builders.py build_profile_job). */}}
{{- define "exitplan.profilerServiceAccountName" -}}
exitplan-profiler
{{- end -}}

{{/* An image reference: repository@digest when image.digest is set (it overrides the tag), else
     repository:tag (the tag defaulting to the chart's appVersion). Call with (list $image $). */}}
{{- define "exitplan.image" -}}
{{- $image := index . 0 -}}
{{- $root := index . 1 -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "exitplan.operatorImage" -}}
{{- include "exitplan.image" (list .Values.operator.image .) -}}
{{- end -}}

{{- define "exitplan.dataPlaneImage" -}}
{{- include "exitplan.image" (list .Values.dataPlane.image .) -}}
{{- end -}}

{{/* "true" when the replicas run in a kopf peering (cluster-wide mode only). */}}
{{- define "exitplan.peering" -}}
{{- if and .Values.leaderElection.enabled (not .Values.namespaces.restrictWatch) -}}true{{- end -}}
{{- end -}}

{{/* The port of every router and worker (operator/builders.py PORT): inference, peers and /metrics. */}}
{{- define "exitplan.dataPlanePort" -}}
8080
{{- end -}}

{{/* The routers' control port (operator/builders.py CONTROL_PORT): thresholds, feedback, observations. */}}
{{- define "exitplan.controlPort" -}}
8081
{{- end -}}
