#!/usr/bin/env bash
# Kubernetes quickstart on kind: cluster, image, Envoy Gateway, InferencePool CRDs, the prefix-epp
# chart, three simulated vLLM replicas, and a test request through the Gateway.
#
#   scripts/kind-up.sh            # create or update everything, then send two requests
#   scripts/kind-up.sh --down     # delete the kind cluster
#
# Needs docker (a running engine), kind (see KIND_MIN_VERSION in versions.env), kubectl, helm
# (v3.8+ or v4) and curl, plus network access to pull the base image, Envoy Gateway's chart and
# the CRD release manifests. It cannot run where no Docker engine is available (such as the
# project's CI machines); tests/deploy checks it with `bash -n` and shellcheck instead, and
# `make test` builds and smoke-tests the image itself with podman. Re-running is safe: every step
# creates or updates in place.
#
# Versions come from versions.env (the kind node image is pinned in kind-config.yaml).
# Settings (environment): CLUSTER_NAME, IMAGE, EG_VERSION, GIE_VERSION, GATEWAY_PORT, MODEL.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The value of KEY in versions.env.
pinned() { sed -n "s/^$1=//p" "$ROOT/versions.env"; }
CLUSTER_NAME="${CLUSTER_NAME:-prefix-epp}"
# The image of every workload: the picker (chart) and the simulated model servers.
IMAGE="${IMAGE:-prefix-epp:dev}"
NAMESPACE="prefix-epp"
RELEASE="prefix-epp"
# Envoy Gateway release: FullDuplexStreamed ext_proc, endpointOverride and the Backend API.
EG_VERSION="${EG_VERSION:-$(pinned EG_VERSION)}"
# Gateway API Inference Extension release whose manifests.yaml holds the InferencePool CRDs.
GIE_VERSION="${GIE_VERSION:-$(pinned GIE_VERSION)}"
GIE_CRDS="https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/${GIE_VERSION}/manifests.yaml"
# kind-config.yaml maps the Gateway's NodePort 30080 to this host port.
GATEWAY_PORT="${GATEWAY_PORT:-8080}"
# The model the simulator serves (manifests/base/simulator.yaml).
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"

log() { printf '\n==> %s\n' "$*"; }
die() { printf 'kind-up: %s\n' "$*" >&2; exit 1; }

if [[ "${1:-}" == "--down" ]]; then
  kind delete cluster --name "$CLUSTER_NAME"
  exit 0
fi

for tool in docker kind kubectl helm curl; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool is required (see docs/kubernetes.md)"
done
docker info >/dev/null 2>&1 || die "no Docker engine is reachable (docker info failed)"

log "kind cluster ${CLUSTER_NAME}"
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER_NAME"; then
  echo "exists"
else
  kind create cluster --name "$CLUSTER_NAME" --config "$ROOT/kind-config.yaml" --wait 120s
fi
kubectl config use-context "kind-${CLUSTER_NAME}" >/dev/null

log "image ${IMAGE}"
docker build --tag "$IMAGE" "$ROOT"
# An image archive loads with every Docker image store; `kind load docker-image` fails with
# Docker's containerd image store (the default in recent Docker releases).
archive="$(mktemp -d)/image.tar"
docker save --output "$archive" "$IMAGE"
kind load image-archive "$archive" --name "$CLUSTER_NAME"
rm -f "$archive"

log "Envoy Gateway ${EG_VERSION} (with the Backend API, used for TLS to the picker)"
helm upgrade --install eg oci://docker.io/envoyproxy/gateway-helm --version "$EG_VERSION" \
  --namespace envoy-gateway-system --create-namespace \
  --set config.envoyGateway.extensionApis.enableBackend=true \
  --wait --timeout 5m
kubectl wait --namespace envoy-gateway-system --for=condition=Available deployment/envoy-gateway --timeout=5m

log "InferencePool CRDs (Gateway API Inference Extension ${GIE_VERSION})"
kubectl apply --server-side --force-conflicts -f "$GIE_CRDS"
kubectl wait --for=condition=Established crd/inferencepools.inference.networking.k8s.io --timeout=60s

log "namespace, GatewayClass and simulated vLLM replicas"
kubectl apply -f "$ROOT/manifests/base/namespace.yaml"
kubectl apply -f "$ROOT/manifests/base/gatewayclass.yaml"
# The simulator runs from the same image as the picker.
kubectl set image --local --filename "$ROOT/manifests/base/simulator.yaml" "*=${IMAGE}" --output yaml \
  | kubectl apply --filename -

log "prefix-epp chart"
helm upgrade --install "$RELEASE" "$ROOT/charts/prefix-epp" --namespace "$NAMESPACE" \
  --values "$ROOT/manifests/values-kind.yaml" --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" \
  --set envoyGateway.version="$EG_VERSION"
# A rebuilt image keeps its tag; restart so the pods run the new build.
kubectl --namespace "$NAMESPACE" rollout restart deployment/vllm-sim "deployment/${RELEASE}"
kubectl --namespace "$NAMESPACE" rollout status deployment/vllm-sim --timeout=3m
kubectl --namespace "$NAMESPACE" rollout status "deployment/${RELEASE}" --timeout=3m
kubectl --namespace "$NAMESPACE" wait --for=condition=Programmed "gateway/${RELEASE}-gateway" --timeout=5m

log "test requests through the Gateway (http://localhost:${GATEWAY_PORT})"
prompt="You are a helpful assistant. Answer briefly. Question: what does a prefix cache store?"
body=$(printf '{"model": "%s", "prompt": "%s", "max_tokens": 16}' "$MODEL" "$prompt")
send() {
  curl --silent --show-error --fail-with-body --retry 20 --retry-delay 3 --retry-all-errors \
    --max-time 30 --dump-header - --output /dev/null \
    --header 'content-type: application/json' --data "$body" \
    "http://localhost:${GATEWAY_PORT}/v1/completions" | tr -d '\r' | awk -F': ' 'tolower($1) == "x-served-by" {print $2}'
}
first=$(send) || die "the request through the Gateway failed; see docs/kubernetes.md (Troubleshooting)"
second=$(send) || die "the second request failed"
[[ -n "$first" ]] || die "no x-served-by header: the response did not come from a simulator pod"
echo "first request served by:  ${first}"
echo "second request served by: ${second} (same prompt prefix, so the picker prefers the same pod)"
echo
echo "Done. Try: curl -s localhost:${GATEWAY_PORT}/v1/completions -H 'content-type: application/json' -d '${body}'"
