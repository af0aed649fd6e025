#!/usr/bin/env bash
# Usage: hsm-fixtures/install-cargo-tool.sh CRATE VERSION   (prints the path of its binary)
#
# The cargo tools the build uses: cargo-deny (licenses, duplicate crates, sources, advisories:
# deny.toml; hsm-fixtures/test.sh) and cargo-deb (the Debian package; hsm-fixtures/package.sh).
# Each is built from crates.io once per machine at the pinned version and cached outside the
# clone (a few minutes the first time on 2 cores, nothing after that).
set -euo pipefail
if (($# != 2)); then
  sed -n '2,7s/^# \{0,1\}//p' "$0" >&2
  exit 2
fi
CRATE=$1
VERSION=$2
ROOT=${HWKEY_CACHE:-/var/cache/hwkey}/$CRATE/$VERSION
if [[ ! -x "$ROOT/bin/$CRATE" ]]; then
  echo "install-cargo-tool: building $CRATE $VERSION into $ROOT (once per machine)" >&2
  mkdir -p "$ROOT"
  cargo install --locked --quiet --version "$VERSION" --root "$ROOT" "$CRATE" >&2
fi
echo "$ROOT/bin/$CRATE"
