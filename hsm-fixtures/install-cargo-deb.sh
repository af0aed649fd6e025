#!/usr/bin/env bash
# Usage: hsm-fixtures/install-cargo-deb.sh   (prints the path of the cargo-deb binary)
#
# cargo-deb builds hwkey's Debian package from the metadata in Cargo.toml
# ([package.metadata.deb]). It is built from crates.io once per machine, pinned, and cached
# outside the clone, like cargo-deny (a few minutes the first time on 2 cores, nothing after).
set -euo pipefail
VERSION=3.8.0
ROOT=${HWKEY_CACHE:-/var/cache/hwkey}/cargo-deb/$VERSION
if [[ ! -x "$ROOT/bin/cargo-deb" ]]; then
  echo "install-cargo-deb: building cargo-deb $VERSION into $ROOT (once per machine)" >&2
  mkdir -p "$ROOT"
  cargo install --locked --quiet --version "$VERSION" --root "$ROOT" cargo-deb >&2
fi
echo "$ROOT/bin/cargo-deb"
