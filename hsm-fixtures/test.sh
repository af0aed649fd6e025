#!/usr/bin/env bash
# Usage: hsm-fixtures/test.sh [extra cargo test arguments]
#
# The full test suite: installs what the tests need (hsm-fixtures/install-deps.sh), then runs
# every test against real SoftHSMv2, swtpm, openssl, nginx, curl and kubectl. Nothing is mocked
# and nothing is skipped: a missing tool fails the test that needs it, naming what to install.
set -euo pipefail
cd "$(dirname "$0")/.."
hsm-fixtures/install-deps.sh
exec cargo test --locked --all-targets --no-fail-fast "$@"
