{{/* The OpenAI-compatible gateway's names (gateway-*.yaml). */}}

{{- define "dpcoord.gatewayName" -}}
{{- printf "%s-gateway" (include "dpcoord.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
