{{/* Chart name, overridable with nameOverride. */}}
{{- define "prefix-epp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: the release name, suffixed with the chart name unless it already contains it. */}}
{{- define "prefix-epp.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "prefix-epp.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "prefix-epp.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: prefix-epp
{{- end -}}

{{/* Labels that select the picker's pods. */}}
{{- define "prefix-epp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "prefix-epp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "prefix-epp.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "prefix-epp.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Name of the InferencePool the picker serves. */}}
{{- define "prefix-epp.poolName" -}}
{{- default .Release.Name .Values.inferencePool.name -}}
{{- end -}}

{{/* In-cluster DNS name of the picker Service. */}}
{{- define "prefix-epp.serviceHost" -}}
{{- printf "%s.%s.svc.%s" (include "prefix-epp.fullname" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{- define "prefix-epp.gatewayName" -}}
{{- default (printf "%s-gateway" (include "prefix-epp.fullname" .)) .Values.envoyGateway.gateway.name -}}
{{- end -}}

{{- define "prefix-epp.routeName" -}}
{{- include "prefix-epp.fullname" . -}}
{{- end -}}

{{- define "prefix-epp.modelServiceName" -}}
{{- default (printf "%s-models" (include "prefix-epp.poolName" .)) .Values.envoyGateway.modelService.name -}}
{{- end -}}

{{/* Plain Envoy Gateway wiring (ext_proc policy, traffic policy, model Service) is rendered. */}}
{{- define "prefix-epp.plainEnvoyGateway" -}}
{{- if and .Values.envoyGateway.enabled (not .Values.envoyGateway.inferencePoolBackend) -}}
true
{{- end -}}
{{- end -}}

{{/* Path of the EndpointPickerConfig file inside the container. */}}
{{- define "prefix-epp.configFile" -}}
{{- printf "%s/config.yaml" (trimSuffix "/" .Values.config.mountPath) -}}
{{- end -}}

{{/* Supported Envoy Gateway releases (versions.env at the repository root; tests/deploy checks
they agree): the oldest whose CRDs accept every object this chart renders, the oldest with
BackendTLSPolicy v1 (verified TLS to the picker), and the newest tested. */}}
{{- define "prefix-epp.egMinVersion" -}}v1.5.0{{- end -}}
{{- define "prefix-epp.egVerifiedTLSMinVersion" -}}v1.6.0{{- end -}}
{{- define "prefix-epp.egNewestTested" -}}v1.9.0{{- end -}}
{{/* Inference Extension CRDs: InferencePool v1 with spec.appProtocol needs v1.4.0. */}}
{{- define "prefix-epp.gieMinVersion" -}}v1.4.0{{- end -}}
{{- define "prefix-epp.gieNewestTested" -}}v1.6.0{{- end -}}

{{/* Fail rendering when envoyGateway.version is too old for what the values ask for. */}}
{{- define "prefix-epp.checkEnvoyGatewayVersion" -}}
{{- $v := .Values.envoyGateway.version -}}
{{- $min := include "prefix-epp.egMinVersion" . -}}
{{- if not (semverCompare (printf ">=%s" $min) $v) -}}
{{- fail (printf "envoyGateway.version %s is not supported: the Envoy Gateway wiring needs %s or newer (FullDuplexStreamed ext_proc, endpointOverride, Backend tls.insecureSkipVerify); upgrade Envoy Gateway or set envoyGateway.enabled=false" $v $min) -}}
{{- end -}}
{{- $tlsMin := include "prefix-epp.egVerifiedTLSMinVersion" . -}}
{{- if and .Values.tls.enabled .Values.envoyGateway.pickerTLS.caConfigMap (not .Values.envoyGateway.inferencePoolBackend) (not (semverCompare (printf ">=%s" $tlsMin) $v)) -}}
{{- fail (printf "envoyGateway.pickerTLS.caConfigMap needs Envoy Gateway %s or newer (BackendTLSPolicy gateway.networking.k8s.io/v1); envoyGateway.version is %s. Upgrade Envoy Gateway, or leave caConfigMap empty (TLS without verification through an Envoy Gateway Backend)" $tlsMin $v) -}}
{{- end -}}
{{- end -}}
