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
# which tests/it/shipping/clean_root.rs installs into a clean Debian 12 root and
# tests/it/shipping/approver_image.rs runs under runc against the real kube-apiserver; the
# approver's memory test runs the release binary. Made in the background at the lowest CPU and
# I/O priority while the debug build compiles and the suite runs, so it takes only the CPU they
# leave: with CI's build cache (.ci/run) the hwkey crate's release build, about 6 minutes, ends
# with the suite; from a clean checkout the release build ends about 10 minutes after it.
# Release and debug builds lock different directories.
# The three tests that need the package run once it is made (RELEASED below); its output is
# printed then.
mkdir -p target
PACKAGE_LOG=target/package.log
# Its own process group (job control, for the start only), so that a run stopped early stops
# it too; not its own session, which the scheduler's autogroups would give an equal share.
set -m
nice -n 19 ionice -c 3 -t hsm-fixtures/package.sh >"$PACKAGE_LOG" 2>&1 &
PACKAGE_PID=$!
set +m
trap 'kill -- "-$PACKAGE_PID" 2>/dev/null || true' EXIT
RELEASED=(shipping::clean_root:: shipping::approver_image::
    approver::round_two::megabyte_requests_in_the_cluster_cost_a_starting_approver_little_memory)
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
# A test that hangs fails its cargo run after a limit (HWKEY_TEST_LIMIT, or the minutes given),
# naming the tests still running then, rather than holding the run until CI's 90 minutes are
# over with nothing said (a hang in key::tpm did that once). `timeout` runs the command in a
# process group of its own and signals all of it (cargo, the test binary and what the tests
# started; outlived.sh reaps the rest); an interrupt or a TERM of this script is passed on to
# it, and the script then stops. The output goes to a log that `tail` shows as it comes.
limited() {
    local minutes=$1
    shift
    local limit=${HWKEY_TEST_LIMIT:-${minutes}m} log pid tailer rc=0 stopped=""
    log=$(mktemp)
    timeout --kill-after=30s "$limit" "$@" >"$log" 2>&1 &
    pid=$!
    trap 'stopped=1; kill -TERM "$pid" 2>/dev/null' INT TERM HUP
    tail -n +1 -f --pid="$pid" "$log" &
    tailer=$!
    wait "$pid" && rc=0 || rc=$?
    # An interrupt ends `wait` early: wait on until the command has stopped.
    while [[ -n $stopped ]] && kill -0 "$pid" 2>/dev/null; do
        wait "$pid" && rc=0 || rc=$?
    done
    wait "$tailer" || true
    trap - INT TERM HUP
    if [[ -n $stopped ]]; then
        rm -f "$log"
        exit 130
    fi
    if [[ $rc == 124 || $rc == 137 ]]; then
        echo "test.sh: stopped after $limit: $*" >&2
        echo "test.sh: the tests that ran over 60 seconds and had not ended then:" >&2
        grep -o 'test [^ ]* has been running for over 60 seconds' "$log" | cut -d' ' -f2 | sort -u |
            while read -r name; do
                grep -q "test $name \.\.\. " "$log" || echo "  $name" >&2
            done
    fi
    rm -f "$log"
    return "$rc"
}
# Every proxy the suite starts (directly, or through kubectl's exec plugin) confines its network
# side fully or refuses to start: a test that needs a hole in the sandbox fails.
export HWKEY_SANDBOX=required
# Everything, with both backends (the default build). Three tests at a time on two cores: the
# tests wait on real servers (kube-apiserver, etcd, swtpm, kubectl) more than they compute, and a
# third took the suite from 845 s to 743 s here. Their assertions are counts and orders, not clocks.
HWKEY_TEST_RUN=$RUN RUST_TEST_THREADS=${RUST_TEST_THREADS:-3} limited 45 \
    cargo test --locked --all-targets --no-fail-fast "$@" -- "${RELEASED[@]/#/--skip=}" || status=1
hsm-fixtures/outlived.sh "$RUN" || status=1
# The package, then the tests that need it (the same build: nothing compiles).
if ! wait "$PACKAGE_PID"; then
    echo "test.sh: hsm-fixtures/package.sh failed (its output follows)" >&2
    status=1
fi
trap - EXIT
cat "$PACKAGE_LOG" >&2
echo "== tests of what hsm-fixtures/package.sh made: ${RELEASED[*]}" >&2
HWKEY_TEST_RUN=$RUN RUST_TEST_THREADS=${RUST_TEST_THREADS:-3} limited 15 \
    cargo test --locked --test it --no-fail-fast "$@" -- "${RELEASED[@]}" || status=1
hsm-fixtures/outlived.sh "$RUN" || status=1
# Each backend alone (Cargo features `pkcs11` and `tpm`): the integration tests compiled for that
# build. What differs between builds is the key layer (which backends open, create, list and
# delete keys, and the error naming a backend that was not built), the CLI around it (manual,
# `attest`, `approver`), what the binary links (a PKCS#11-only binary maps no TSS2 library) and
# what ships; the proxy's data path, its listeners and its sandbox are the same code in every
# build and run once, in the default build above.
# - pkcs11-only: the key layer and its CLI (key::), the exec plugin with kubectl end to end
#   (exec::), what ships and what the build links (shipping::), the fixtures, and the proxy's
#   signer split, transport and local authentication on this build's binary.
# - tpm-only: everything it compiles but the approver's tests on the real API server
#   (tests/it/approver): the approver is the same code as in the default build (it needs the
#   TPM backend to check evidence, and nothing of PKCS#11).
# Running the whole suite three times took the run past its 30 minutes.
for backend in pkcs11 tpm; do
    echo "== tests of the ${backend}-only build" >&2
    if [[ $backend == tpm ]]; then
        select=(-- --skip approver::)
        echo "test.sh: the tpm-only build skips tests/it/approver (run in the default build above)" >&2
    else
        select=(-- key:: exec:: shipping:: fixtures:: proxy::signer:: proxy::transport:: proxy::local_auth::)
        echo "test.sh: the pkcs11-only build runs what differs between builds: ${select[*]:1}" >&2
    fi
    HWKEY_TEST_RUN=$RUN limited 25 cargo test --locked --no-default-features --features "$backend" \
        --test it --no-fail-fast "$@" "${select[@]}" || status=1
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
