#!/usr/bin/env bash
# Usage: hsm-fixtures/profile.sh [OUT_DIR]
#
# Profiles the proxy process under the end-to-end benchmark's load (benches/e2e) and writes,
# into OUT_DIR (default docs/profiles):
#   new-connections.svg   flame graph of `hwkey proxy` during HWKEY_BENCH_ONLY=handshakes
#                         (new client connections over the UNIX socket and loopback TLS)
#   bulk.svg              flame graph during HWKEY_BENCH_ONLY=throughput (64 MiB downloads)
#   requests.svg          flame graph during HWKEY_BENCH_ONLY=requests (small keep-alive GETs)
#   loopback.svg          flame graph during HWKEY_BENCH_ONLY=loopback (the loopback TLS path:
#                         keep-alive, new connections, downloads, h2 with watches)
#   NAME.txt              beside each flame graph: the same samples by binary and by symbol
#   syscalls.txt          `strace -c` of the proxy over a whole throughput run (805 MB relayed:
#                         12 downloads of 64 MiB), with calls per MB
#
# Samples are taken system-wide (perf record -a, DWARF call graphs, 999 Hz) and filtered to the
# proxy's threads (comm `hwkey-proxy*`). Needs perf and strace (installed here with apt)
# and inferno (cargo install inferno). Takes about two minutes once the benches are built.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/profiles}
mkdir -p "$out"

hsm-fixtures/install-deps.sh
if ! command -v perf >/dev/null || ! command -v strace >/dev/null; then
  apt-get install -y --no-install-recommends linux-perf strace >&2
fi
if ! command -v inferno-flamegraph >/dev/null; then
  cargo install --locked inferno >&2
fi
export PATH="$HOME/.cargo/bin:$PATH"

cargo bench --locked --no-run --bench e2e >&2
# The proxy the benches start is a release build with its symbols stripped: profile one built
# the same way with symbols and line tables kept (its own target directory), via HWKEY_BIN.
CARGO_PROFILE_RELEASE_STRIP=none CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
  cargo build --release --locked --bin hwkey --bin hwkey-net --target-dir target/profiling >&2
export HWKEY_BIN=$PWD/target/profiling/release/hwkey
bench=$(cargo bench --locked --no-run --bench e2e 2>&1 | sed -n 's/.*Executable .*(\(.*\))/\1/p' | tail -1)
[[ -x "$bench" ]] || { echo "profile.sh: cannot find the e2e bench binary" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The proxy's threads: the accept loop and admin (hwkey-proxy), the connection runtimes
# (hwkey-proxy-conn) and the relay loops (hwkey-proxy-relay), as the kernel truncates them.
comms=hwkey-proxy,hwkey-proxy-con,hwkey-proxy-rel
profile() { # NAME FIGURE TITLE
  echo "profile.sh: $1 (HWKEY_BENCH_ONLY=$2)" >&2
  HWKEY_BENCH_ONLY=$2 perf record -q -a -F 999 --call-graph dwarf,16384 -o "$tmp/$1.data" \
    -- "$bench" --bench >"$tmp/$1.log" 2>&1
  perf script -i "$tmp/$1.data" --comms "$comms" 2>/dev/null |
    inferno-collapse-perf >"$tmp/$1.folded"
  inferno-flamegraph --title "$3" --width 1600 <"$tmp/$1.folded" >"$out/$1.svg"
  # The same samples as text: shares by binary and the heaviest symbols (self time).
  # (`perf report --comms` selects nothing in these system-wide recordings; the comm column
  # is filtered here instead.)
  perf report -i "$tmp/$1.data" --no-children -g none -n --sort comm,dso,sym --stdio 2>/dev/null |
    summarise "$3" >"$out/$1.txt"
}

# perf report's "overhead, samples, comm, dso, sym" lines → the proxy threads' share by binary
# and their top 30 symbols, as percentages of the proxy threads' samples.
summarise() { # TITLE
  awk -v title="$1" '
    $1 ~ /%$/ { all += $2 }
    $1 ~ /%$/ && $3 ~ /^hwkey-proxy/ {
      n = $2; total += n; dso[$4] += n
      sym = $0; sub(/^ *[0-9.]+% +[0-9]+ +[^ ]+ +[^ ]+ +\[.\] /, "", sym); gsub(/ +$/, "", sym)
      bysym[$4 "  " sym] += n
    }
    END {
      if (total == 0) { print "profile.sh: no samples of the proxy threads" > "/dev/stderr"; exit 1 }
      printf "# %s\n# the proxy threads (comm hwkey-proxy*): %d samples, %.1f %% of all; by binary:\n", title, total, 100 * total / all
      for (d in dso) printf "%6.1f %%  %s\n", 100 * dso[d] / total, d | "sort -rn"
      close("sort -rn")
      print "# heaviest symbols, self time, % of the proxy threads'"'"' samples:"
      for (s in bysym) printf "%6.2f %%  %s\n", 100 * bysym[s] / total, s | "sort -rn | head -30"
      close("sort -rn | head -30")
    }'
}

profile new-connections handshakes "hwkey proxy: new client connections (UNIX socket and loopback TLS), $(date -u +%F)"
profile bulk throughput "hwkey proxy: 64 MiB downloads (UNIX socket and loopback TLS), $(date -u +%F)"
profile requests requests "hwkey proxy: small keep-alive requests (HTTP/1.1 on 8 and 64 connections, h2), $(date -u +%F)"
profile loopback loopback "hwkey proxy: the loopback TLS path (keep-alive, new connections, downloads, h2 with watches), $(date -u +%F)"

echo "profile.sh: system calls over a throughput run" >&2
proxy_bin=$HWKEY_BIN
HWKEY_BENCH_ONLY=throughput "$bench" --bench >"$tmp/strace-run.log" 2>&1 &
runner=$!
pid=
for _ in $(seq 2000); do
  # `hwkey proxy` runs on as `hwkey-net proxy` (the network side; the signer is its child).
  pid=$(pgrep -f "^$proxy_bin(-net)? proxy" | head -1 || true)
  [[ -n "$pid" ]] && break
  sleep 0.01
done
[[ -n "$pid" ]] || { echo "profile.sh: the proxy did not start" >&2; exit 1; }
strace -c -f -p "$pid" -o "$tmp/strace.txt" 2>/dev/null || true
wait "$runner"
{
  echo "# strace -c -f of hwkey proxy over HWKEY_BENCH_ONLY=throughput (805 MB relayed), $(date -u +%F)"
  awk 'NR > 2 && $4 ~ /^[0-9]+$/ {
         name = ($5 ~ /^[0-9]+$/) ? $6 : $5
         printf "%-16s %9d calls %8.1f per MB\n", name, $4, $4 / 805
       }' "$tmp/strace.txt" | sort -k2 -n -r
} >"$out/syscalls.txt"
cat "$out/syscalls.txt" >&2
echo "profile.sh: wrote $out" >&2
