#!/usr/bin/env bash
# Usage: hsm-fixtures/baseline.sh REF
#
# Builds hwkey (release) as it was at git commit REF, for benchmarks that compare this build with
# an earlier one in the same run (hsm-fixtures/bench.sh --baseline REF), and prints the binary's
# path. The build is kept under target/baseline/<commit> and reused: a second run returns at once.
# Since the signer split (issue 35) `hwkey proxy` execs `hwkey-net` from beside itself: a commit
# that has it gets it built and copied too, and so does its exec plugin `hwkey-credential`.
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:?usage: hsm-fixtures/baseline.sh REF (a commit, tag or branch)}
commit=$(git rev-parse --verify "$ref^{commit}") || {
  echo "baseline.sh: '$ref' is not a commit of this repository" >&2
  exit 1
}
dest="target/baseline/$commit"
# The binaries beside hwkey that the commit has: hwkey-net (the proxy's network side, issue 35)
# and hwkey-credential (the exec plugin, which the e2e exec step times against this build's).
bins=(hwkey)
for extra in hwkey-net hwkey-credential; do
  if git cat-file -e "$commit:src/bin/$extra.rs" 2>/dev/null; then
    bins+=("$extra")
  fi
done
built=1
for bin in "${bins[@]}"; do
  [[ -x "$dest/$bin" ]] || built=0
done
if ((built == 1)); then
  echo "$PWD/$dest/hwkey"
  exit 0
fi
src="target/baseline/src-$commit"
rm -rf "$src"
mkdir -p "$src"
git archive "$commit" | tar -x -C "$src"
echo "baseline.sh: building ${bins[*]} at ${commit:0:12} (release; once per commit)" >&2
(cd "$src" && CARGO_TARGET_DIR="$PWD/../target-$commit" cargo build --release --locked "${bins[@]/#/--bin=}" >&2)
mkdir -p "$dest"
for bin in "${bins[@]}"; do
  cp "target/baseline/target-$commit/release/$bin" "$dest/$bin"
done
rm -rf "$src" "target/baseline/target-$commit"
echo "$PWD/$dest/hwkey"
