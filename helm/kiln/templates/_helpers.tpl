{{/* The release's base name: the release name when it already says "kiln", else "<release>-kiln". */}}
{{- define "kiln.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kiln.operatorName" -}}
{{- printf "%s-operator" (include "kiln.fullname" .) -}}
{{- end -}}

{{- define "kiln.serviceAccountName" -}}
{{- default (include "kiln.operatorName" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "kiln.selectorLabels" -}}
app.kubernetes.io/name: kiln
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels of every object, without the component. */}}
{{- define "kiln.commonLabels" -}}
app.kubernetes.io/name: kiln
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: kiln
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}


{{- define "kiln.labels" -}}
{{ include "kiln.commonLabels" . }}
app.kubernetes.io/component: operator
{{- end -}}
