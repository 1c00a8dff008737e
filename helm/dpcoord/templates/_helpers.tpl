{{/* Names and labels. */}}

{{- define "dpcoord.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dpcoord.fullname" -}}
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

{{- define "dpcoord.coordinatorName" -}}
{{- printf "%s-coordinator" (include "dpcoord.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dpcoord.engineName" -}}
{{- printf "%s-engine" (include "dpcoord.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dpcoord.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "dpcoord.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dpcoord
{{- end }}

{{/* Selector labels of one component: call with (dict "root" $ "component" "coordinator"). */}}
{{- define "dpcoord.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dpcoord.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "dpcoord.image" -}}
{{- printf "%s:%s" .image.repository (.image.tag | default .root.Chart.AppVersion) }}
{{- end }}

{{/* NATS. */}}

{{/*
The Secret the bundled nats-server includes its users and permissions from. Only the release
name goes into it, because the nats sub-chart's values name it too (through $tplYaml, in the
sub-chart's own context, where this chart's values are out of sight).
*/}}
{{- define "dpcoord.natsServerAuthSecret" -}}
{{- printf "%s-dpcoord-nats-auth" .Release.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The Secret holding each component's NATS credentials (keys <component>-user, ...). */}}
{{- define "dpcoord.natsCredentialsSecret" -}}
{{- if .Values.nats.enabled }}
{{- printf "%s-nats-credentials" (include "dpcoord.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- .Values.externalNats.credentialsSecret }}
{{- end }}
{{- end }}

{{/* How components authenticate: none, userPassword, token, creds or nkey. */}}
{{- define "dpcoord.natsAuthMethod" -}}
{{- if .Values.nats.enabled }}
{{- ternary "userPassword" "none" .Values.natsAuth.enabled }}
{{- else if .Values.externalNats.credentialsSecret }}
{{- .Values.externalNats.auth }}
{{- else }}
{{- "none" }}
{{- end }}
{{- end }}

{{/* The bundled NATS's name, as the nats chart computes it (nats.fullname). */}}
{{- define "dpcoord.natsFullname" -}}
{{- $name := .Values.nats.fullnameOverride | default (ternary .Release.Name (printf "%s-nats" .Release.Name) (contains "nats" .Release.Name)) }}
{{- $name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dpcoord.natsUrl" -}}
{{- if .Values.nats.enabled }}
{{- printf "nats://%s.%s.svc:%d" (include "dpcoord.natsFullname" .) .Release.Namespace (dig "config" "nats" "port" 4222 .Values.nats | int) }}
{{- else }}
{{- required "externalNats.url is required when nats.enabled is false" .Values.externalNats.url }}
{{- end }}
{{- end }}

{{/*
A setting's value as its DPCOORD_ environment variable: strings as they are, numbers and
booleans through JSON (Helm holds numbers as float64, and printing 1048576 plainly gives
1.048576e+06, which no integer setting accepts).
*/}}
{{- define "dpcoord.envValue" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ toJson . }}{{ end }}
{{- end }}

{{/*
Environment shared by every dpcoord container: settings from the ConfigMap, the NATS URL, this
component's reply-inbox prefix (its role's, _INBOX_<component>, as docs/security.md and
docs/nats-server.example.conf give each role) and its NATS credentials. Call with
(dict "root" $ "component" "coordinator").
*/}}
{{- define "dpcoord.natsEnv" -}}
{{- $root := .root }}
{{- $component := .component }}
{{- $method := include "dpcoord.natsAuthMethod" $root }}
{{- $secret := include "dpcoord.natsCredentialsSecret" $root -}}
- name: DPCOORD_NATS_URL
  value: {{ include "dpcoord.natsUrl" $root | quote }}
- name: DPCOORD_NATS_INBOX_PREFIX
  value: {{ printf "_INBOX_%s" $component | quote }}
{{- if eq $method "userPassword" }}
- name: DPCOORD_NATS_USER
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $component }}-user
- name: DPCOORD_NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $component }}-password
{{- else if eq $method "token" }}
- name: DPCOORD_NATS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $component }}-token
{{- else if eq $method "creds" }}
- name: DPCOORD_NATS_CREDS_FILE
  value: {{ printf "/etc/dpcoord/nats-credentials/%s.creds" $component | quote }}
{{- else if eq $method "nkey" }}
- name: DPCOORD_NATS_NKEY_SEED_FILE
  value: {{ printf "/etc/dpcoord/nats-credentials/%s.nk" $component | quote }}
{{- end }}
{{- end }}

{{/* Volumes for NATS credential files and TLS; with dpcoord.natsVolumeMounts. */}}
{{- define "dpcoord.natsVolumes" -}}
{{- $method := include "dpcoord.natsAuthMethod" . -}}
{{- if or (eq $method "creds") (eq $method "nkey") }}
- name: nats-credentials
  secret:
    secretName: {{ include "dpcoord.natsCredentialsSecret" . }}
    defaultMode: 0440
{{- end }}
{{- with .Values.natsTls.secret }}
- name: nats-tls
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "dpcoord.natsVolumeMounts" -}}
{{- $method := include "dpcoord.natsAuthMethod" . -}}
{{- if or (eq $method "creds") (eq $method "nkey") }}
- name: nats-credentials
  mountPath: /etc/dpcoord/nats-credentials
  readOnly: true
{{- end }}
{{- if .Values.natsTls.secret }}
- name: nats-tls
  mountPath: /etc/dpcoord/nats-tls
  readOnly: true
{{- end }}
{{- end }}

{{/* Probes on the endpoints the services serve (service/http_endpoints.py). */}}
{{- define "dpcoord.probe" -}}
httpGet:
  path: {{ .path }}
  port: http
{{- toYaml .timing | nindent 0 }}
{{- end }}
