#!/usr/bin/env bash
# Usage: hsm-fixtures/build-kube.sh
#
# Builds a real kube-apiserver and kube-controller-manager from Debian 12's `kubernetes` source
# package (1.20.2) for the lifecycle tests, once per machine, and prints the directory that holds
# them. The binaries are cached outside the clone, keyed by the source package version:
#   ${HWKEY_KUBE_CACHE:-/var/cache/hwkey/kube}/<version>/{kube-apiserver,kube-controller-manager}
# A second run finds them and returns at once. Also installs etcd-server (the API server's
# store). Takes about 6-8 minutes on 2 cores the first time. Needs root (apt-get).
set -euo pipefail

CACHE_ROOT=${HWKEY_KUBE_CACHE:-/var/cache/hwkey/kube}
SUDO=()
if [[ "$(id -u)" -ne 0 ]]; then
  command -v sudo >/dev/null 2>&1 || { echo "build-kube: run as root (or install sudo)" >&2; exit 1; }
  SUDO=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive

# deb-src twins of the configured Debian sources, so `apt-get source` finds the package.
SRC_LIST=/etc/apt/sources.list.d/hwkey-deb-src.sources
if ! apt-cache showsrc kubernetes 2>/dev/null | grep -q '^Version:'; then
  if [[ ! -f "$SRC_LIST" ]]; then
    "${SUDO[@]}" tee "$SRC_LIST" >/dev/null <<'SOURCES'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
  fi
  "${SUDO[@]}" apt-get update -qq >&2
fi

need=()
for pkg in golang-go rsync etcd-server dpkg-dev; do
  [[ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)" == "install ok installed" ]] || need+=("$pkg")
done
if ((${#need[@]} > 0)); then
  echo "build-kube: installing ${need[*]}" >&2
  "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi

version=$(apt-cache showsrc kubernetes | sed -n 's/^Version: //p' | sort -V | tail -n 1)
[[ -n "$version" ]] || { echo "build-kube: no source package 'kubernetes' (deb-src missing?)" >&2; exit 1; }
dest="$CACHE_ROOT/$version"
if [[ -x "$dest/kube-apiserver" && -x "$dest/kube-controller-manager" ]]; then
  echo "$dest"
  exit 0
fi

"${SUDO[@]}" mkdir -p "$CACHE_ROOT"
# One build at a time per machine; the loser of the race finds the winner's binaries.
exec 9>"$CACHE_ROOT/.lock"
flock 9
if [[ -x "$dest/kube-apiserver" && -x "$dest/kube-controller-manager" ]]; then
  echo "$dest"
  exit 0
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/hwkey-kube-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "build-kube: building kube-apiserver and kube-controller-manager $version in $work (once per machine)" >&2
(
  cd "$work"
  apt-get source --download-only "kubernetes=$version" >&2
  dpkg-source -x kubernetes_*.dsc src >&2
  cd src
  GO=$(ls -d /usr/lib/go-1.*/bin | sort -V | tail -n 1)
  PATH="$GO:$PATH" CGO_ENABLED=0 GOPROXY=off GOTOOLCHAIN=local GOFLAGS=-mod=vendor \
    make WHAT="cmd/kube-apiserver cmd/kube-controller-manager" >&2
)
tmp="$dest.tmp.$$"
mkdir -p "$tmp"
cp "$work/src/_output/bin/kube-apiserver" "$work/src/_output/bin/kube-controller-manager" "$tmp/"
rm -rf "$dest"
mv "$tmp" "$dest"
echo "$dest"
