#!/usr/bin/env bash
# Usage: hsm-fixtures/stop-swtpm.sh DIR
#
# Stops the swtpm started by hsm-fixtures/start-swtpm.sh DIR (by DIR/swtpm.pid) and waits
# up to 5 seconds for it to exit. Does nothing if it is not running.
set -euo pipefail

if (($# != 1)); then
  sed -n '2,5s/^# \{0,1\}//p' "$0" >&2
  exit 2
fi

PIDFILE="$1/swtpm.pid"
if [[ ! -f "$PIDFILE" ]]; then
  echo "stop-swtpm: no $PIDFILE, nothing to stop" >&2
  exit 0
fi

PID=$(cat "$PIDFILE")
if kill -0 "$PID" 2>/dev/null && [[ "$(ps -p "$PID" -o comm= 2>/dev/null)" == swtpm* ]]; then
  kill "$PID"
  for _ in $(seq 1 50); do
    kill -0 "$PID" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$PID" 2>/dev/null; then
    kill -9 "$PID"
  fi
fi
rm -f "$PIDFILE"
