#!/usr/bin/env bash
# Usage: hsm-fixtures/bench.sh [--quick] [--baseline REF]
#
# The benchmark suite: installs what it needs (hsm-fixtures/install-deps.sh, nothing more),
# builds in release, runs the micro benchmarks (benches/sign.rs, criterion), the end-to-end
# harness (benches/e2e/; HWKEY_BENCH_ONLY=memory,... picks figures), the crypto-provider
# comparison (benches/providers.rs), rustls per small record (benches/records.rs), the uid lookup of loopback admission (benches/admission.rs,
# printed), the approver's capacity (benches/approver.rs) and kubectl
# against the real kube-apiserver (benches/kubectl_apiserver.rs; both use the API server
# hsm-fixtures/build-kube.sh builds once per machine) on private SoftHSM tokens, swtpm, the
# kube-apiserver stand-in and /usr/bin/kubectl, then writes docs/BENCHMARKS.md (benches/report.rs).
#
# --baseline REF: also measure hwkey as it was at git commit REF where a figure compares builds
# (the approver's decisions; the proxy's keep-alive requests and bulk download, e2e step
# "baseline"; hsm-fixtures/baseline.sh builds it once per commit).
#
# --quick: few, short repetitions (under a minute once built), for development. The full run
# takes a few minutes on 2 cores; run it when the machine is otherwise idle (`uptime`), since
# the report records the load average but cannot undo it.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
baseline=
while (($# > 0)); do
  arg=$1
  shift
  case "$arg" in
    --quick) quick=1 ;;
    --baseline)
      baseline=${1:?--baseline needs a git commit}
      shift
      ;;
    -h | --help)
      sed -n '2,/^set -euo/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "bench.sh: unknown argument '$arg' (use --quick, --baseline REF or nothing)" >&2
      exit 2
      ;;
  esac
done

hsm-fixtures/install-deps.sh
if [[ ! -x /usr/bin/kubectl ]]; then
  echo "bench.sh: /usr/bin/kubectl is missing; the kubectl figures will be reported as not measured" >&2
fi

export HWKEY_BENCH_QUICK=$quick
if [[ -n "$baseline" ]]; then
  HWKEY_BENCH_BASELINE_BIN=$(hsm-fixtures/baseline.sh "$baseline")
  HWKEY_BENCH_BASELINE_REF=$(git rev-parse --short=12 "$baseline")
  export HWKEY_BENCH_BASELINE_BIN HWKEY_BENCH_BASELINE_REF
fi
# Results of an earlier run must not leak into this report.
rm -f target/hwkey-bench/sign.json target/hwkey-bench/e2e.json target/hwkey-bench/records.json target/hwkey-bench/providers.json target/hwkey-bench/approver.json target/hwkey-bench/apiserver.json

echo "bench.sh: building (release)" >&2
cargo bench --locked --no-run --bench sign --bench e2e --bench admission --bench records --bench approver --bench kubectl_apiserver --bench report
cargo bench --locked --no-run --features bench-aws-lc --bench providers
echo "bench.sh: load average before: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
cargo bench --locked --bench sign
cargo bench --locked --bench e2e
cargo bench --locked --bench admission
cargo bench --locked --bench records
cargo bench --locked --features bench-aws-lc --bench providers
HWKEY_KUBE_BIN=$(hsm-fixtures/build-kube.sh) cargo bench --locked --bench approver
HWKEY_KUBE_BIN=$(hsm-fixtures/build-kube.sh) cargo bench --locked --bench kubectl_apiserver
cargo bench --locked --bench report
echo "bench.sh: wrote docs/BENCHMARKS.md" >&2
