{{/* High availability pieces of the picker pod: peer sync, workers, drain (docs/high-availability.md). */}}

{{/* Name of the Secret holding the peers' shared sync secret (key "secret"). */}}
{{- define "prefix-epp.syncSecretName" -}}
{{- default (printf "%s-sync" (include "prefix-epp.fullname" .)) .Values.ha.sync.existingSecret -}}
{{- end -}}

{{/* Seconds the picker drains after SIGTERM: the grace period less the preStop sleep and a 2 s margin. */}}
{{- define "prefix-epp.drainSeconds" -}}
{{- max 1 (sub (sub .Values.terminationGracePeriodSeconds .Values.ha.drain.preStopSleepSeconds) 2) -}}
{{- end -}}

{{/* `prefix-epp serve` flags of the HA settings. */}}
{{- define "prefix-epp.haArgs" -}}
- --workers={{ .Values.ha.workers }}
- --drain-timeout={{ include "prefix-epp.drainSeconds" . }}s
{{- if .Values.ha.sync.enabled }}
- --sync-port={{ .Values.ha.sync.port }}
- --peer-selector={{ include "prefix-epp.selectorLabels" . | replace ": " "=" | replace "\n" "," }}
- --sync-warm-timeout={{ .Values.ha.sync.warmTimeout }}
- --sync-secret-file={{ include "prefix-epp.syncSecretDir" . }}/secret
{{- end }}
{{- end -}}

{{/* Directory the sync Secret is mounted at; the picker reads the file "secret" in it. */}}
{{- define "prefix-epp.syncSecretDir" -}}/etc/prefix-epp/sync{{- end -}}

{{/* Container volume mounts of the HA settings: the sync secret as a file, never an environment
variable (environment variables leak into `kubectl describe`, crash dumps and child processes). */}}
{{- define "prefix-epp.haVolumeMounts" -}}
{{- if .Values.ha.sync.enabled }}
- name: sync-secret
  mountPath: {{ include "prefix-epp.syncSecretDir" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* Pod volumes of the HA settings. */}}
{{- define "prefix-epp.haVolumes" -}}
{{- if .Values.ha.sync.enabled }}
- name: sync-secret
  secret:
    secretName: {{ include "prefix-epp.syncSecretName" . }}
    defaultMode: 0440  # root and the pod's fsGroup (the picker runs in it)
    items:
      - key: secret
        path: secret
{{- end }}
{{- end -}}

{{/* Container port of peer sync. */}}
{{- define "prefix-epp.haPorts" -}}
{{- if .Values.ha.sync.enabled }}
- name: sync
  containerPort: {{ .Values.ha.sync.port }}
  protocol: TCP
{{- end }}
{{- end -}}

{{/* preStop: keep serving while Envoy and the endpoints controller stop sending, then SIGTERM drains. */}}
{{- define "prefix-epp.haLifecycle" -}}
{{- if gt (int .Values.ha.drain.preStopSleepSeconds) 0 }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ .Values.ha.drain.preStopSleepSeconds }}"]
{{- end }}
{{- end -}}

{{/* Spread the replicas over nodes (and zones when the nodes carry the label). */}}
{{- define "prefix-epp.haSpread" -}}
{{- if and .Values.ha.spread.enabled (not .Values.affinity) }}
topologySpreadConstraints:
  {{- range .Values.ha.spread.topologyKeys }}
  - maxSkew: 1
    topologyKey: {{ . }}
    whenUnsatisfiable: {{ $.Values.ha.spread.whenUnsatisfiable }}
    labelSelector:
      matchLabels:
        {{- include "prefix-epp.selectorLabels" $ | nindent 8 }}
  {{- end }}
{{- end }}
{{- end -}}
