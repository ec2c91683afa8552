{{/*
The operator's RBAC rules, least privilege. tests/test_rbac.py derives what the code needs — the
application's calls by scanning operator/ (KubeClient calls, kopf.adopt, kopf.event) and kopf's own
calls from the handlers kopf has registered plus kopf's source — and checks these rules match it
exactly: nothing missing, nothing extra.
  "kopf:" marks what the framework needs, "app:" what exitplan's own code calls.
*/}}

{{/* Rules on cluster-scoped resources: always in a ClusterRole. */}}
{{- define "exitplan.rules.cluster" -}}
# kopf: discover resources as CRDs come and go (kopf/_core/reactor/observation.py resource_observer).
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
# app: read the GPUPools a service names (operator/reconcile.py read_inputs: get);
# kopf: the GPUPool event handler that re-plans their services (operator/handlers.py pool_event: list, watch).
- apiGroups: ["exitplan.io"]
  resources: ["gpupools"]
  verbs: ["get", "list", "watch"]
{{- if include "exitplan.peering" . }}
# kopf: leader election: watch the peers (list, watch) and post this replica's keep-alive (patch)
# in the ClusterKopfPeering (kopf/_core/engines/peering.py).
# app: create that ClusterKopfPeering when absent (operator/peering.py ensure_peering: get, create).
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch", "create"]
{{- end }}
{{- if .Values.namespaces.restrictWatch }}
# kopf, namespaced mode: observe the namespaces it serves (observation.py namespace_observer).
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end -}}

{{/* Rules on namespaced resources: in the ClusterRole (all namespaces) or one Role per served namespace. */}}
{{- define "exitplan.rules.namespaced" -}}
# kopf: watch EarlyExitServices (list, watch); store handler progress and the diff base in
# annotations and add the finalizer its timer needs (patch).
# app: list the services waiting for a ModelProfile (operator/handlers.py profile_event).
- apiGroups: ["exitplan.io"]
  resources: ["earlyexitservices"]
  verbs: ["list", "watch", "patch"]
# app: write the fixed status (operator/reconcile.py Service.write_status).
- apiGroups: ["exitplan.io"]
  resources: ["earlyexitservices/status"]
  verbs: ["patch"]
# app: children get ownerReferences with blockOwnerDeletion (kopf.adopt in operator/builders.py);
# clusters running the OwnerReferencesPermissionEnforcement admission plugin require this.
- apiGroups: ["exitplan.io"]
  resources: ["earlyexitservices/finalizers"]
  verbs: ["update"]
# kopf: the ModelProfile event handler (list, watch); app: read_inputs lists the profiles (list).
- apiGroups: ["exitplan.io"]
  resources: ["modelprofiles"]
  verbs: ["list", "watch"]
# kopf + app: events about services (operator/events.py: created, then patched to count repeats;
# kopf's handler errors).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
# app: the plan ConfigMap and the router/split Services (operator/apply.py apply_one, delete_one,
# list_children; reconcile.py current_plan; driftloop.py router_urls).
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "create", "patch", "delete"]
# app: the router/split Services, as above, and watched for the ticks (tick_reads.py).
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# app: every router replica's address for /v1/observations: the control Service's Endpoints
# (operator/router_endpoints.py find_routers; listed and watched once per namespace, tick_reads.py).
- apiGroups: [""]
  resources: ["endpoints"]
  verbs: ["get", "list", "watch"]
# app: router pods' IPs for /v1/observations (operator/router_endpoints.py, where there are no
# Endpoints); the init container
# statuses of a service's pods, for a remote bundle they cannot fetch (operator/bundle_health.py); the
# router Pods watched (tick_reads.py).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# app: router and worker Deployments (operator/apply.py; reconcile.py refresh_readiness; watched once per
# namespace for the ticks, tick_reads.py).
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# app: the routers' PodDisruptionBudget (operator/disruption.py, applied, listed and pruned by
# operator/apply.py like the other children).
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "create", "patch", "delete"]
# app: each service's own NetworkPolicies (operator/network_policies.py, applied, listed and pruned
# by operator/apply.py like the other children).
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "create", "patch", "delete"]
# app: profiling Jobs (operator/reconcile.py ensure_profiling; apply.py list_children). Finished
# Jobs expire by ttlSecondsAfterFinished and go with their service, so no delete.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "create", "patch"]
{{- end -}}

{{/* Secrets: never cluster-wide. Always in a Role of each namespace of namespaces.services, whatever
     the watch mode: the operator reads and creates Secrets only where services are meant to run. */}}
{{- define "exitplan.rules.secrets" -}}
# app: each service's control token (operator/control_token.py: read it to call the routers'
# control endpoints, create it once, before the pods that mount it).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
{{- end -}}

{{/* The profiling Job's `exitplan operator publish-profile` (exitplan/cmd_operator.py publish_profile
     -> operator/apply.py apply_one): get, create or patch one ModelProfile in its namespace; the
     bundle-info Job's `exitplan operator publish-bundle-info` (publish_bundle_info ->
     operator/bundle_info.py publish): get, create or patch one ConfigMap. */}}
{{- define "exitplan.rules.profiler" -}}
# app: publish the measured ModelProfile (exitplan/cmd_operator.py publish_profile).
- apiGroups: ["exitplan.io"]
  resources: ["modelprofiles"]
  verbs: ["get", "create", "patch"]
# app: publish a remote generation bundle's bundle.yaml and measurements as the ConfigMap the
# operator plans from (exitplan/cmd_operator.py publish_bundle_info, operator/bundle_info.py).
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
{{- end -}}
