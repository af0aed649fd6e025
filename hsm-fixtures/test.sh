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
# The Debian package and the approver's OCI image (release build, cargo deb, lintian, umoci),
# which tests/it/shipping/clean_root.rs installs into a clean Debian 12 root and tests/it/shipping/approver_image.rs
# runs under runc against the real kube-apiserver.
hsm-fixtures/package.sh >&2 || status=1
# Dependency policy (deny.toml): licenses, duplicate crates, sources.
DENY=$(hsm-fixtures/install-cargo-tool.sh cargo-deny 0.20.2)
"$DENY" check licenses bans sources || status=1
# Security advisories, offline: the RustSec database comes from the snapshot in
# ../shared/rustsec (these machines cannot reach github.com), cloned where cargo-deny looks for
# its default database; the run names the snapshot's date. No snapshot and no github.com is a
# failure, never a silent skip.
ADVISORY_BUNDLE=${HWKEY_ADVISORY_BUNDLE:-../shared/rustsec/advisory-db.bundle}
if [[ -f "$ADVISORY_BUNDLE" ]]; then
    # cargo-deny's directory name for https://github.com/rustsec/advisory-db.
    ADVISORY_DB=${CARGO_HOME:-$HOME/.cargo}/advisory-dbs/advisory-db-3157b0e258782691
    rm -rf "$ADVISORY_DB"
    mkdir -p "$(dirname "$ADVISORY_DB")"
    git -c init.defaultBranch=main -c advice.detachedHead=false clone -q "$ADVISORY_BUNDLE" "$ADVISORY_DB"
    echo "test.sh: security advisories from the RustSec snapshot of $(git -C "$ADVISORY_DB" log -1 --format=%cs) (commit $(git -C "$ADVISORY_DB" rev-parse --short HEAD))" >&2
    "$DENY" --offline check advisories || status=1
elif getent hosts github.com >/dev/null; then
    "$DENY" check advisories || status=1
else
    echo "test.sh: security advisories NOT checked: no RustSec snapshot at $ADVISORY_BUNDLE and github.com is unreachable" >&2
    status=1
fi
# Structure (docs/ARCHITECTURE.md): the layering of src/, no import cycles, no function over 80
# lines, no Result<_, String>, fewer than 20 `reason: String` fields. Prints the counts.
python3 hsm-fixtures/structure.py || status=1
# Tests leave nothing running: every process a test starts inherits HWKEY_TEST_RUN, and
# hsm-fixtures/outlived.sh names, stops and fails on whatever still carries it after cargo.
RUN="$$-$(date +%s%N)"
# Tests write only in their own temporary directories: a file that appears in the checkout
# during the run (a SoftHSM object file with a garbage name once did, from a use after free)
# fails the run, named.
UNTRACKED_BEFORE=$(git status --porcelain --untracked-files=all 2>/dev/null | grep '^??' || true)
# Every proxy the suite starts (directly, or through kubectl's exec plugin) confines its network
# side fully or refuses to start: a test that needs a hole in the sandbox fails.
export HWKEY_SANDBOX=required
# Everything, with both backends (the default build).
HWKEY_TEST_RUN=$RUN cargo test --locked --all-targets --no-fail-fast "$@" || status=1
hsm-fixtures/outlived.sh "$RUN" || status=1
# Each backend alone (Cargo features `pkcs11` and `tpm`): the integration tests compiled for that
# build, including the check that a PKCS#11-only binary links no TSS2 library. The approver's
# tests on the real API server (tests/it/approver) run once, in the default build above: the
# approver is the same code in the TPM-only build (it needs the TPM backend to check evidence,
# and nothing of PKCS#11), and running them twice would take the suite past its 30 minutes.
for backend in pkcs11 tpm; do
    echo "== tests of the ${backend}-only build" >&2
    skip=()
    if [[ $backend == tpm ]]; then
        skip=(-- --skip approver::)
        echo "test.sh: the tpm-only build skips tests/it/approver (run in the default build above)" >&2
    else
        # The real API server's renewals and bootstraps (2+ minutes of waiting on it) run the
        # same SoftHSM code in both builds: once, above, keeps the run under 30 minutes.
        skip=(-- --skip lifecycle::)
        echo "test.sh: the pkcs11-only build skips tests/it/lifecycle (run in the default build above)" >&2
    fi
    HWKEY_TEST_RUN=$RUN cargo test --locked --no-default-features --features "$backend" --test it \
        --no-fail-fast "$@" "${skip[@]}" || status=1
    hsm-fixtures/outlived.sh "$RUN" || status=1
done
UNTRACKED_AFTER=$(git status --porcelain --untracked-files=all 2>/dev/null | grep '^??' || true)
NEW_FILES=$(comm -13 <(sort <<<"$UNTRACKED_BEFORE") <(sort <<<"$UNTRACKED_AFTER") | sed '/^$/d')
if [[ -n "$NEW_FILES" ]]; then
    echo "test.sh: the tests left files in the checkout (a test wrote outside its temporary directory):" >&2
    sed 's/^/  /' <<<"$NEW_FILES" >&2
    status=1
fi
exit "$status"
