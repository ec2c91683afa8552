#!/usr/bin/env bash
# Cluster end-to-end on kind: create the cluster (bundle mounted into the nodes), build and load the
# CPU images, then run e2e/cluster/test_kind_cluster.py, which helm-installs charts/exitplan, applies
# a GPUPool mapped to the kind nodes and an EarlyExitService, waits for it to profile, plan and roll
# out, and replays the Azure trace through the router Service.
#
#   e2e/cluster/run.sh                  # everything, then deletes the cluster
#   EXITPLAN_E2E_KEEP=1 e2e/cluster/run.sh   # leave the cluster and the release for a look around
#
# Needs: docker, kind, kubectl, and the project's .venv (make install). The MiniLM bundle is built
# with `exitplan prepare` when artifacts/bundles/minilm does not hold one.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CLUSTER="${EXITPLAN_E2E_CLUSTER:-exitplan-e2e}"
TAG="${EXITPLAN_E2E_TAG:-e2e}"
BUNDLE="${EXITPLAN_E2E_BUNDLE:-$ROOT/artifacts/bundles/minilm}"
VENV="${VENV:-$ROOT/.venv}"
OPERATOR_IMAGE="exitplan-operator:$TAG"
WORKER_IMAGE="exitplan-worker-cpu:$TAG"

need() {
  command -v "$1" >/dev/null 2>&1 || { echo "error: '$1' is not on PATH; $2" >&2; exit 2; }
}
need docker "install Docker (https://docs.docker.com/engine/install/)"
need kind "install kind (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)"
need kubectl "install kubectl (https://kubernetes.io/docs/tasks/tools/)"
[ -x "$VENV/bin/exitplan" ] || { echo "error: $VENV/bin/exitplan is missing; run 'make install' first" >&2; exit 2; }

echo "==> 1/5 model bundle: $BUNDLE"
if [ ! -f "$BUNDLE/bundle.yaml" ]; then
  "$VENV/bin/exitplan" prepare --model minilm --out "$BUNDLE"
fi
BUNDLE="$(cd "$BUNDLE" && pwd)"

echo "==> 2/5 kind cluster '$CLUSTER'"
if ! kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  CONFIG="$(mktemp)"
  sed "s#@BUNDLE@#$BUNDLE#g" "$ROOT/e2e/cluster/kind.yaml" > "$CONFIG"
  kind create cluster --name "$CLUSTER" --config "$CONFIG" --wait 120s
  rm -f "$CONFIG"
fi
KUBECONFIG="$(mktemp)"
export KUBECONFIG
kind get kubeconfig --name "$CLUSTER" > "$KUBECONFIG"

cleanup() {
  rm -f "$KUBECONFIG"
  if [ -z "${EXITPLAN_E2E_KEEP:-}" ]; then
    kind delete cluster --name "$CLUSTER"
  else
    echo "kept: kind cluster '$CLUSTER' (kind get kubeconfig --name $CLUSTER)"
  fi
}
trap cleanup EXIT

echo "==> 3/5 images: $OPERATOR_IMAGE, $WORKER_IMAGE"
docker build --target operator -t "$OPERATOR_IMAGE" "$ROOT"
docker build --target worker-cpu -t "$WORKER_IMAGE" "$ROOT"

echo "==> 4/5 load the images into the nodes"
kind load docker-image --name "$CLUSTER" "$OPERATOR_IMAGE" "$WORKER_IMAGE"

echo "==> 5/5 helm install, GPUPool + EarlyExitService, the trace through the Service"
EXITPLAN_E2E_OPERATOR_IMAGE="$OPERATOR_IMAGE" EXITPLAN_E2E_WORKER_IMAGE="$WORKER_IMAGE" EXITPLAN_E2E_BUNDLE="$BUNDLE" \
  "$VENV/bin/python" -m pytest -v -p no:cacheprovider "$ROOT/e2e/cluster" "$@"
