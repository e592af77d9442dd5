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

{{/* The Gateway the route attaches to: the chart's own (envoyGateway.gateway.create) or an
existing one, whose name is then required. */}}
{{- define "prefix-epp.gatewayName" -}}
{{- if include "prefix-epp.attach" . -}}
{{- required "envoyGateway.gateway.name is required with envoyGateway.gateway.create=false: the name of the existing Gateway to attach the route to" .Values.envoyGateway.gateway.name -}}
{{- else -}}
{{- default (printf "%s-gateway" (include "prefix-epp.fullname" .)) .Values.envoyGateway.gateway.name -}}
{{- end -}}
{{- end -}}

{{/* Namespace of that Gateway: the release's for the chart's own Gateway. */}}
{{- define "prefix-epp.gatewayNamespace" -}}
{{- if include "prefix-epp.attach" . -}}
{{- default .Release.Namespace .Values.envoyGateway.gateway.namespace -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/* Attach mode: the route and its policies join an existing Gateway; no Gateway or EnvoyProxy of
the chart's own. */}}
{{- define "prefix-epp.attach" -}}
{{- if and .Values.envoyGateway.enabled (not .Values.envoyGateway.gateway.create) -}}
true
{{- end -}}
{{- end -}}

{{/* Refuse values that only mean something for an existing Gateway when the chart makes its own. */}}
{{- define "prefix-epp.checkGatewayValues" -}}
{{- $gw := .Values.envoyGateway.gateway -}}
{{- if and $gw.create (or $gw.namespace $gw.sectionName) -}}
{{- fail "envoyGateway.gateway.namespace and sectionName name an existing Gateway's namespace and listener: set envoyGateway.gateway.create=false (and gateway.name) to attach to it, or leave them empty for the chart's own Gateway (release namespace, listener \"http\")" -}}
{{- end -}}
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
{{- define "prefix-epp.egNewestTested" -}}v1.9.1{{- end -}}
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
{{- if and .Values.tls.enabled (not .Values.envoyGateway.pickerTLS.insecureSkipVerify) (not .Values.envoyGateway.inferencePoolBackend) (not (semverCompare (printf ">=%s" $tlsMin) $v)) -}}
{{- fail (printf "verifying the picker's certificate needs Envoy Gateway %s or newer (BackendTLSPolicy gateway.networking.k8s.io/v1); envoyGateway.version is %s. Upgrade Envoy Gateway, or set envoyGateway.pickerTLS.insecureSkipVerify=true (TLS without verification through an Envoy Gateway Backend: whoever takes the picker's address receives every prompt)" $tlsMin $v) -}}
{{- end -}}
{{- end -}}

{{/* TLS of the ext_proc port (templates/tls.yaml). "generated": the chart makes the picker's
certificate (tls.enabled, tls.generate, no tls.existingSecret). */}}
{{- define "prefix-epp.tlsGenerated" -}}
{{- if and .Values.tls.enabled .Values.tls.generate (not .Values.tls.existingSecret) -}}
true
{{- end -}}
{{- end -}}

{{/* A certificate Secret is mounted (given or generated); else the picker makes a self-signed one. */}}
{{- define "prefix-epp.tlsMounted" -}}
{{- if and .Values.tls.enabled (or .Values.tls.existingSecret .Values.tls.generate) -}}
true
{{- end -}}
{{- end -}}

{{/* Mutual TLS: the picker requires a client certificate signed by tls.clientCA. */}}
{{- define "prefix-epp.clientAuth" -}}
{{- if .Values.tls.clientCA.name -}}
{{- if not .Values.tls.enabled -}}
{{- fail "tls.clientCA needs tls.enabled: client certificates are checked in the TLS handshake" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* The Secret (tls.crt, tls.key) the picker serves ext_proc with: given, or the generated one. */}}
{{- define "prefix-epp.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "prefix-epp.fullname" .)) .Values.tls.existingSecret -}}
{{- end -}}

{{/* ConfigMap (key ca.crt) of the CA Envoy Gateway verifies the picker with. */}}
{{- define "prefix-epp.caConfigMapName" -}}
{{- if .Values.envoyGateway.pickerTLS.caConfigMap -}}
{{- .Values.envoyGateway.pickerTLS.caConfigMap -}}
{{- else if include "prefix-epp.tlsGenerated" . -}}
{{- printf "%s-ca" (include "prefix-epp.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The generated certificate as a dict of base64 fields (tls.crt, tls.key, ca.crt): the existing
Secret's when the cluster has one (helm install/upgrade), else a new CA and a certificate it signs
for the picker Service's names. Made once per render and cached in .Values.tls, so the Secret,
the CA ConfigMap and the pod's checksum see the same certificate. */}}
{{- define "prefix-epp.tlsData" -}}
{{- if not (hasKey .Values.tls "_data") -}}
{{- $name := include "prefix-epp.tlsSecretName" . -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace $name -}}
{{- $data := dict -}}
{{- if and $existing (hasKey (default dict $existing.data) "tls.crt") (hasKey $existing.data "tls.key") (hasKey $existing.data "ca.crt") -}}
{{- $data = dict "tls.crt" (index $existing.data "tls.crt") "tls.key" (index $existing.data "tls.key") "ca.crt" (index $existing.data "ca.crt") -}}
{{- else -}}
{{- $full := include "prefix-epp.fullname" . -}}
{{- $ns := .Release.Namespace -}}
{{- $names := list $full (printf "%s.%s" $full $ns) (printf "%s.%s.svc" $full $ns) (include "prefix-epp.serviceHost" .) -}}
{{- $ca := genCA (printf "%s-ca" $full) (int .Values.tls.validityDays) -}}
{{- $cert := genSignedCert (include "prefix-epp.serviceHost" .) nil $names (int .Values.tls.validityDays) $ca -}}
{{- $data = dict "tls.crt" ($cert.Cert | b64enc) "tls.key" ($cert.Key | b64enc) "ca.crt" ($ca.Cert | b64enc) -}}
{{- end -}}
{{- $_ := set .Values.tls "_data" $data -}}
{{- end -}}
{{- toJson .Values.tls._data -}}
{{- end -}}

{{/* The picker's image. Nothing is published to a registry, so the repository must be given. */}}
{{- define "prefix-epp.image" -}}
{{- $repo := required (printf "image.repository is required: no prefix-epp image is published to a registry. Build it from the repository's Dockerfile (`make image`, or `docker build -t REGISTRY/prefix-epp:%s .`), push it to your registry and set image.repository (and image.tag, default %s, the chart's appVersion)" .Chart.AppVersion .Chart.AppVersion) .Values.image.repository -}}
{{- printf "%s:%s" $repo (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
