#!/usr/bin/env bash
# Usage: hsm-fixtures/install-cargo-deny.sh   (prints the path of the cargo-deny binary)
#
# cargo-deny checks licenses, duplicate crates and sources (deny.toml). It is built from
# crates.io once per machine, pinned, and cached outside the clone (about 4 minutes the first
# time on 2 cores, nothing after that).
set -euo pipefail
VERSION=0.20.2
ROOT=${HWKEY_CACHE:-/var/cache/hwkey}/cargo-deny/$VERSION
if [[ ! -x "$ROOT/bin/cargo-deny" ]]; then
  echo "install-cargo-deny: building cargo-deny $VERSION into $ROOT (once per machine)" >&2
  mkdir -p "$ROOT"
  cargo install --locked --quiet --version "$VERSION" --root "$ROOT" cargo-deny >&2
fi
echo "$ROOT/bin/cargo-deny"
