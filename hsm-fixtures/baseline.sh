#!/usr/bin/env bash
# Usage: hsm-fixtures/baseline.sh REF
#
# Builds hwkey (release) as it was at git commit REF, for benchmarks that compare this build with
# an earlier one in the same run (hsm-fixtures/bench.sh --baseline REF), and prints the binary's
# path. The build is kept under target/baseline/<commit> and reused: a second run returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:?usage: hsm-fixtures/baseline.sh REF (a commit, tag or branch)}
commit=$(git rev-parse --verify "$ref^{commit}") || {
  echo "baseline.sh: '$ref' is not a commit of this repository" >&2
  exit 1
}
dest="target/baseline/$commit"
if [[ -x "$dest/hwkey" ]]; then
  echo "$PWD/$dest/hwkey"
  exit 0
fi
src="target/baseline/src-$commit"
rm -rf "$src"
mkdir -p "$src"
git archive "$commit" | tar -x -C "$src"
echo "baseline.sh: building hwkey at ${commit:0:12} (release; once per commit)" >&2
(cd "$src" && CARGO_TARGET_DIR="$PWD/../target-$commit" cargo build --release --locked --bin hwkey >&2)
mkdir -p "$dest"
cp "target/baseline/target-$commit/release/hwkey" "$dest/hwkey"
rm -rf "$src" "target/baseline/target-$commit"
echo "$PWD/$dest/hwkey"
