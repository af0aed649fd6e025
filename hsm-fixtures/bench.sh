#!/usr/bin/env bash
# Usage: hsm-fixtures/bench.sh [--quick]
#
# The benchmark suite: installs what it needs (hsm-fixtures/install-deps.sh, nothing more),
# builds in release, runs the micro benchmarks (benches/sign.rs, criterion), the end-to-end
# harness (benches/e2e/; HWKEY_BENCH_ONLY=memory,... picks figures), the crypto-provider
# comparison (benches/providers.rs), the uid lookup of loopback admission (benches/admission.rs,
# printed), the approver's capacity (benches/approver.rs) and kubectl
# against the real kube-apiserver (benches/kubectl_apiserver.rs; both use the API server
# hsm-fixtures/build-kube.sh builds once per machine) on private SoftHSM tokens, swtpm, the
# kube-apiserver stand-in and /usr/bin/kubectl, then writes docs/BENCHMARKS.md (benches/report.rs).
#
# --quick: few, short repetitions (under a minute once built), for development. The full run
# takes a few minutes on 2 cores; run it when the machine is otherwise idle (`uptime`), since
# the report records the load average but cannot undo it.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    -h | --help)
      sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "bench.sh: unknown argument '$arg' (use --quick or nothing)" >&2
      exit 2
      ;;
  esac
done

hsm-fixtures/install-deps.sh
if [[ ! -x /usr/bin/kubectl ]]; then
  echo "bench.sh: /usr/bin/kubectl is missing; the kubectl figures will be reported as not measured" >&2
fi

export HWKEY_BENCH_QUICK=$quick
# Results of an earlier run must not leak into this report.
rm -f target/hwkey-bench/sign.json target/hwkey-bench/e2e.json target/hwkey-bench/providers.json target/hwkey-bench/approver.json target/hwkey-bench/apiserver.json

echo "bench.sh: building (release)" >&2
cargo bench --locked --no-run --bench sign --bench e2e --bench admission --bench approver --bench kubectl_apiserver --bench report
cargo bench --locked --no-run --features bench-aws-lc --bench providers
echo "bench.sh: load average before: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
cargo bench --locked --bench sign
cargo bench --locked --bench e2e
cargo bench --locked --bench admission
cargo bench --locked --features bench-aws-lc --bench providers
HWKEY_KUBE_BIN=$(hsm-fixtures/build-kube.sh) cargo bench --locked --bench approver
HWKEY_KUBE_BIN=$(hsm-fixtures/build-kube.sh) cargo bench --locked --bench kubectl_apiserver
cargo bench --locked --bench report
echo "bench.sh: wrote docs/BENCHMARKS.md" >&2
