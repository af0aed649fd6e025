#!/usr/bin/env bash
# Usage: hsm-fixtures/test.sh [extra cargo test arguments]
#
# The full test suite: installs what the tests need (hsm-fixtures/install-deps.sh), then runs
# every test against real SoftHSMv2, swtpm, openssl, nginx, curl, kubectl and a real
# kube-apiserver + kube-controller-manager (hsm-fixtures/build-kube.sh). Nothing is mocked
# and nothing is skipped: a missing tool fails the test that needs it, naming what to install.
set -euo pipefail
cd "$(dirname "$0")/.."
hsm-fixtures/install-deps.sh
# A real kube-apiserver + kube-controller-manager for the lifecycle tests: built from Debian's
# source package once per machine and cached outside the clone (a few seconds when cached).
HWKEY_KUBE_BIN=$(hsm-fixtures/build-kube.sh)
export HWKEY_KUBE_BIN
status=0
# Dependency policy (deny.toml): licenses, duplicate crates, sources.
DENY=$(hsm-fixtures/install-cargo-deny.sh)
"$DENY" check licenses bans sources || status=1
# Security advisories need the RustSec database from github.com; say so loudly when it is out
# of reach rather than pretending the check ran.
if getent hosts github.com >/dev/null; then
    "$DENY" check advisories || status=1
else
    echo "test.sh: security advisories NOT checked: github.com (RustSec advisory-db) is unreachable from this machine" >&2
fi
# Everything, with both backends (the default build).
cargo test --locked --all-targets --no-fail-fast "$@" || status=1
# Each backend alone (Cargo features `pkcs11` and `tpm`): the integration tests compiled for that
# build, including the check that a PKCS#11-only binary links no TSS2 library.
for backend in pkcs11 tpm; do
    echo "== tests of the ${backend}-only build" >&2
    cargo test --locked --no-default-features --features "$backend" --test it --no-fail-fast "$@" \
        || status=1
done
exit "$status"
