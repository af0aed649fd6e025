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
exec cargo test --locked --all-targets --no-fail-fast "$@"
