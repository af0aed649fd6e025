#!/usr/bin/env bash
# Usage: hsm-fixtures/clean-root.sh   (prints the path of a tarball)
#
# A minimal Debian 12 root (mmdebstrap's "apt" variant: the Essential packages and apt, no
# compiler, no -dev package, no Rust) as a tarball, for the test that installs hwkey's .deb into
# it (tests/it/shipping/clean_root.rs). Made once per machine and cached outside the clone, like
# the kube binaries: a minute or two the first time, nothing after. Needs root and Debian's mirror
# (HWKEY_DEBIAN_MIRROR, default http://deb.debian.org).
set -euo pipefail
MIRROR=${HWKEY_DEBIAN_MIRROR:-http://deb.debian.org}
CACHE=${HWKEY_CACHE:-/var/cache/hwkey}/clean-root
TAR=$CACHE/bookworm-apt-v1.tar
if [[ ! -f "$TAR" ]]; then
  if ! command -v mmdebstrap >/dev/null 2>&1; then
    echo "clean-root: mmdebstrap not found: apt-get install mmdebstrap (or run hsm-fixtures/install-deps.sh)" >&2
    exit 1
  fi
  echo "clean-root: making a Debian 12 root with mmdebstrap into $TAR (once per machine)" >&2
  mkdir -p "$CACHE"
  # The machine's clock may be ahead of the mirror's Release files' Valid-Until.
  mmdebstrap --quiet --variant=apt --mode=root --format=tar \
    --aptopt='Acquire::Check-Valid-Until "false"' \
    bookworm "$TAR.partial" \
    "deb $MIRROR/debian bookworm main" \
    "deb $MIRROR/debian bookworm-updates main" \
    "deb $MIRROR/debian-security bookworm-security main" >&2
  mv "$TAR.partial" "$TAR"
fi
echo "$TAR"
