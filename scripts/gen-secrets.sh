#!/usr/bin/env bash
# The secrets of one kubectl rollout of manifests/ (kind: manifests/secrets/, EKS:
# manifests/overlays/eks/secrets/), written as the files the overlay's kustomize generators read:
#   sync-secret          the pickers' shared peer-sync secret (32 random bytes, hex)
#   ca.crt               a CA made for this rollout (its key is deleted once it has signed)
#   tls.crt, tls.key     the picker's certificate for its Service names, signed by that CA
# Nothing here is shared between rollouts or kept in git (.gitignore lists the directories);
# kustomize refuses to build an overlay whose files are missing. Needs openssl.
#   scripts/gen-secrets.sh manifests/secrets
#   scripts/gen-secrets.sh manifests/overlays/eks/secrets
# Existing files are kept (rerunning changes nothing); delete the directory to rotate, then
# re-apply and restart the picker Deployment.
set -euo pipefail

DIR="${1:?usage: $0 DIRECTORY [NAMESPACE] [SERVICE] [CLUSTER_DOMAIN]}"
NAMESPACE="${2:-prefix-epp}"
SERVICE="${3:-prefix-epp}"
CLUSTER_DOMAIN="${4:-cluster.local}"
DAYS="${DAYS:-3650}"

mkdir -p "$DIR"
umask 077
if [[ ! -s "$DIR/sync-secret" ]]; then
  openssl rand -hex 32 | tr -d '\n' > "$DIR/sync-secret"
  echo "wrote $DIR/sync-secret"
fi
if [[ ! -s "$DIR/tls.crt" || ! -s "$DIR/tls.key" || ! -s "$DIR/ca.crt" ]]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  names="DNS:${SERVICE},DNS:${SERVICE}.${NAMESPACE},DNS:${SERVICE}.${NAMESPACE}.svc"
  names="${names},DNS:${SERVICE}.${NAMESPACE}.svc.${CLUSTER_DOMAIN}"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days "$DAYS" \
    -subj "/CN=${SERVICE}-ca" -keyout "$work/ca.key" -out "$work/ca.crt" \
    -addext "basicConstraints=critical,CA:TRUE,pathlen:0" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -subj "/CN=${SERVICE}.${NAMESPACE}.svc.${CLUSTER_DOMAIN}" -keyout "$work/tls.key" -out "$work/tls.csr" 2>/dev/null
  printf 'subjectAltName=%s\nbasicConstraints=critical,CA:FALSE\nextendedKeyUsage=serverAuth\n' "$names" \
    > "$work/ext.cnf"
  openssl x509 -req -in "$work/tls.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" -CAcreateserial \
    -days "$DAYS" -extfile "$work/ext.cnf" -out "$work/tls.crt" 2>/dev/null
  cp "$work/ca.crt" "$work/tls.crt" "$work/tls.key" "$DIR/"
  echo "wrote $DIR/ca.crt, $DIR/tls.crt and $DIR/tls.key (${SERVICE}.${NAMESPACE}.svc.${CLUSTER_DOMAIN})"
fi
