#!/usr/bin/env bash
# Build the Go binaries the benchmark and the Kubernetes API tests run, from source with the Go
# module proxy, and cache them outside the repository. Prints the directory holding the binaries.
#
#   bench/peers/build.sh gie-epp   # the Gateway API Inference Extension endpoint picker (cmd/epp)
#   bench/peers/build.sh kube      # kube-apiserver and etcd
#   bench/peers/build.sh envoy-gateway [VERSION]  # the Envoy Gateway controller and its CRDs
#
# Pinned versions (module proxy; the proxy records the tag's commit, checked below):
#   gie-epp  sigs.k8s.io/gateway-api-inference-extension v1.5.0 (commit df9f8909), the last GIE
#            release that holds the full picker (later ones moved it to llm-d's router)
#   kube     k8s.io/kubernetes v1.35.4 (staging modules k8s.io/* v0.35.4, the standard `replace`
#            set), go.etcd.io/etcd/server/v3 v3.6.5 (the etcd that Kubernetes release pins)
# Cache: ${PREFIX_EPP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/prefix-epp}/<target>/<version>-<commit>/,
# with BUILD-INFO (versions, module sums, go version, build seconds). A cached build is reused.
# GIE_SRC=/path/to/a/snapshot builds gie-epp from that checkout instead (keyed by its git commit,
# or the hash of its go.sum when it is no git checkout). The source is never copied into the repo.
# Builds run under `nice -n 10` with GOFLAGS -p=2 (shared 2-core machines); a lock file serialises
# concurrent callers.
set -euo pipefail

GIE_VERSION=v1.5.0
GIE_COMMIT=df9f8909fe06fe2dfd4a6fc0bd0c01a0acabf849
KUBE_VERSION=v1.35.4
ETCD_VERSION=v3.6.5
# Envoy Gateway module checksums (go.sum h1 lines) of the versions built.
declare -A EG_SUMS=(
  [v1.9.1]="h1:vAVp6/AlBXJ1aOhp1mxL7fNEzVEfjADUguUhm2wzxQY="
  [v1.5.0]="h1:wfHytSeNoinwu0vCtWT61XK23qJuRmJyU+CPWdIJp2I="
)
# v1.5.0's go.mod replace directive (a wrapper module must repeat it: replaces apply only in the
# main module).
EG_V150_REPLACE="replace go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc v0.61.0 => go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc v0.58.0"
CACHE=${PREFIX_EPP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/prefix-epp}
GO=${GO:-$(command -v go || echo /usr/local/go/bin/go)}

die() { echo "build.sh: $*" >&2; exit 1; }
[ $# -ge 1 ] && [ $# -le 2 ] || die "usage: $0 gie-epp|kube|envoy-gateway [VERSION]"
[ -x "$GO" ] || die "no Go toolchain (looked for 'go' on PATH and /usr/local/go/bin/go)"

# build TARGET KEY WRAPPER_GO_MOD PACKAGES...: build PACKAGES inside a throw-away module whose
# go.mod is WRAPPER_GO_MOD, into $CACHE/TARGET/KEY (atomically, under a lock).
build() {
  local target=$1 key=$2 gomod=$3; shift 3
  local out="$CACHE/$target/$key"
  if [ -f "$out/BUILD-INFO" ]; then echo "$out"; return; fi
  mkdir -p "$CACHE/$target"
  exec 9>"$CACHE/$target/.lock"
  flock 9
  if [ -f "$out/BUILD-INFO" ]; then echo "$out"; return; fi
  WORK=$(mktemp -d "$CACHE/$target/.build-XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
  local work=$WORK
  printf '%s\n' "$gomod" > "$work/go.mod"
  # Checksums the wrapped module itself pins (its go.sum): some of its pseudo-versions are unknown
  # to the checksum database, and these are the sums its own build verifies against.
  if [ -n "${GOSUM_FROM:-}" ]; then cp "$GOSUM_FROM" "$work/go.sum"; chmod u+w "$work/go.sum"; fi
  local t0; t0=$(date +%s)
  echo "build.sh: building $target $key (first time; minutes)" >&2
  (cd "$work" && GOFLAGS="-mod=mod -p=2" GOTOOLCHAIN=local nice -n 10 "$GO" build -trimpath -o "$work/bin/" "$@") >&2
  if [ -n "${COPY_FROM_MODULE:-}" ]; then  # files shipped in a dependency module, e.g. CRDs
    local mod dir; mod=${COPY_FROM_MODULE%% *}; dir=${COPY_FROM_MODULE#* }
    local src; src=$(cd "$work" && GOFLAGS=-mod=mod "$GO" list -m -f '{{.Dir}}' "$mod")
    mkdir -p "$work/bin/crds"
    find "$src/$dir" -name '*.yaml' -exec cp {} "$work/bin/crds/" \;
    chmod -R u+w "$work/bin/crds"
  fi
  {
    echo "target: $target"; echo "key: $key"; echo "packages: $*"
    echo "go: $("$GO" version)"; echo "built: $(date -u +%FT%TZ) in $(( $(date +%s) - t0 )) s"
    echo "modules:"; grep -E '^(sigs.k8s.io/gateway-api-inference-extension|k8s.io/kubernetes|go.etcd.io/etcd/server/v3|github.com/envoyproxy/gateway) ' "$work/go.sum" | grep -v '/go.mod ' || true
  } > "$work/bin/BUILD-INFO"
  rm -rf "$out"
  mv "$work/bin" "$out"
  rm -rf "$work"; trap - EXIT
  echo "$out"
}

check_origin() {  # the proxy's record of which commit the tag points at
  local info; info=$(cd /tmp && GOFLAGS=-mod=mod "$GO" mod download -json "$1@$2" 2>/dev/null || true)
  case "$info" in *"$3"*) ;; *) die "$1@$2: the module proxy does not report commit $3";; esac
}

case "$1" in
  gie-epp)
    if [ -n "${GIE_SRC:-}" ]; then
      [ -f "$GIE_SRC/go.mod" ] || die "GIE_SRC=$GIE_SRC holds no go.mod"
      key=$(git -C "$GIE_SRC" rev-parse HEAD 2>/dev/null || sha256sum "$GIE_SRC/go.sum" | cut -c1-40)
      out="$CACHE/gie-epp/src-$key"
      if [ ! -f "$out/BUILD-INFO" ]; then
        mkdir -p "$out.tmp"
        (cd "$GIE_SRC" && GOFLAGS="-p=2" nice -n 10 "$GO" build -trimpath -o "$out.tmp/epp" ./cmd/epp) >&2
        echo "target: gie-epp from $GIE_SRC at $key" > "$out.tmp/BUILD-INFO"
        rm -rf "$out"; mv "$out.tmp" "$out"
      fi
      echo "$out"; exit 0
    fi
    key="$GIE_VERSION-${GIE_COMMIT:0:8}"
    if [ ! -f "$CACHE/gie-epp/$key/BUILD-INFO" ]; then  # cached builds need no network
      check_origin sigs.k8s.io/gateway-api-inference-extension "$GIE_VERSION" "$GIE_COMMIT"
    fi
    build gie-epp "$key" "module prefixepp.local/peers/gie

go 1.25.0

require sigs.k8s.io/gateway-api-inference-extension $GIE_VERSION" \
      sigs.k8s.io/gateway-api-inference-extension/cmd/epp
    ;;
  kube)
    staging="api apiextensions-apiserver apimachinery apiserver cli-runtime client-go cloud-provider
      cluster-bootstrap code-generator component-base component-helpers controller-manager cri-api
      cri-client csi-translation-lib dynamic-resource-allocation endpointslice externaljwt kms
      kube-aggregator kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics
      mount-utils pod-security-admission sample-apiserver sample-cli-plugin sample-controller"
    replaces=""
    for m in $staging; do replaces+=$'\n'"	k8s.io/$m => k8s.io/$m v0${KUBE_VERSION#v1}"; done
    # The version kube-apiserver reports (/version), set as Kubernetes' own build sets it: without
    # it the server says v0.0.0-master and `helm install` refuses charts with a kubeVersion range.
    # The key's -r2 marks that recipe (builds without it were keyed without the suffix).
    minor=${KUBE_VERSION#v1.}; minor=${minor%%.*}
    ldflags="-X k8s.io/component-base/version.gitVersion=$KUBE_VERSION -X k8s.io/component-base/version.gitMajor=1"
    ldflags+=" -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
    build kube "$KUBE_VERSION-etcd-$ETCD_VERSION-r2" "module prefixepp.local/peers/kube

go 1.25.0

require (
	k8s.io/kubernetes $KUBE_VERSION
	go.etcd.io/etcd/server/v3 $ETCD_VERSION
)

replace ($replaces
)" "-ldflags=$ldflags" k8s.io/kubernetes/cmd/kube-apiserver go.etcd.io/etcd/server/v3
    ;;
  envoy-gateway)
    here=$(cd "$(dirname "$0")/../.." && pwd)
    version=${2:-$(sed -n 's/^EG_VERSION=//p' "$here/versions.env")}
    sum=${EG_SUMS[$version]:-}
    [ -n "$sum" ] || die "envoy-gateway $version: no pinned module checksum (known: ${!EG_SUMS[*]})"
    key="$version-$(printf '%s' "$sum" | sha256sum | cut -c1-8)"  # the checksum, in short
    extra=""; crds="charts/gateway-helm/charts/crds/crds"
    if [ "$version" = v1.5.0 ]; then extra=$EG_V150_REPLACE; crds="charts/gateway-helm/crds"; fi
    if [ -f "$CACHE/envoy-gateway/$key/BUILD-INFO" ]; then echo "$CACHE/envoy-gateway/$key"; exit 0; fi
    info=$(cd /tmp && GOFLAGS=-mod=mod "$GO" mod download -json "github.com/envoyproxy/gateway@$version")
    got=$(printf '%s\n' "$info" | sed -n 's/.*"Sum": *"\(.*\)".*/\1/p')
    [ "$got" = "$sum" ] || die "github.com/envoyproxy/gateway@$version: checksum $got, pinned $sum"
    gomod=$(printf '%s\n' "$info" | sed -n 's/.*"GoMod": *"\(.*\)".*/\1/p')
    gover=$(sed -n 's/^go //p' "$gomod")  # the wrapper needs the Go version EG itself declares
    dir=$(printf '%s\n' "$info" | sed -n 's/.*"Dir": *"\(.*\)".*/\1/p')
    GOSUM_FROM="$dir/go.sum" COPY_FROM_MODULE="github.com/envoyproxy/gateway $crds" CGO_ENABLED=0 build envoy-gateway "$key" \
      "module prefixepp.local/peers/envoygateway

go $gover

require github.com/envoyproxy/gateway $version

$extra" github.com/envoyproxy/gateway/cmd/envoy-gateway
    ;;
  *) die "unknown target $1 (gie-epp, kube or envoy-gateway)";;
esac
