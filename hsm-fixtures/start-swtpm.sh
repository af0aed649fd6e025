#!/usr/bin/env bash
# Usage: hsm-fixtures/start-swtpm.sh DIR
#
# Starts a TPM 2.0 simulator (swtpm) in the background with its state in DIR, listening on
# 127.0.0.1:P (TPM commands) and 127.0.0.1:P+1 (control), where P and P+1 are free ports.
# The TPM is started up (startup-clear) so tools can use it at once. Prints the TCTI to use:
#   export TPM2TOOLS_TCTI=$(hsm-fixtures/start-swtpm.sh /tmp/tpm)
# Stop it with hsm-fixtures/stop-swtpm.sh DIR.
set -euo pipefail

if (($# != 1)); then
  sed -n '2,9s/^# \{0,1\}//p' "$0" >&2
  exit 2
fi

DIR=$1
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

port_in_use() {
  # A connect that succeeds means something listens there.
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

pick_port() {
  local p
  for _ in $(seq 1 200); do
    p=$((20000 + RANDOM % 40000))
    if ! port_in_use "$p" && ! port_in_use $((p + 1)); then
      echo "$p"
      return 0
    fi
  done
  echo "start-swtpm: no free port pair found" >&2
  return 1
}

if [[ -f "$DIR/swtpm.pid" ]] && kill -0 "$(cat "$DIR/swtpm.pid")" 2>/dev/null; then
  echo "start-swtpm: swtpm already running for $DIR (pid $(cat "$DIR/swtpm.pid"))" >&2
  exit 1
fi

PORT=$(pick_port)
swtpm socket --tpmstate "dir=$DIR" --tpm2 \
  --server "type=tcp,port=$PORT,bindaddr=127.0.0.1" \
  --ctrl "type=tcp,port=$((PORT + 1)),bindaddr=127.0.0.1" \
  --flags not-need-init,startup-clear \
  --daemon --pid "file=$DIR/swtpm.pid" \
  --log "file=$DIR/swtpm.log"

for _ in $(seq 1 100); do
  if port_in_use "$PORT"; then
    echo "swtpm:host=127.0.0.1,port=$PORT"
    exit 0
  fi
  sleep 0.1
done
echo "start-swtpm: swtpm did not listen on 127.0.0.1:$PORT within 10s (see $DIR/swtpm.log)" >&2
exit 1
