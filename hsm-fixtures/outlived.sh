#!/usr/bin/env bash
# Usage: hsm-fixtures/outlived.sh RUN
#
# Tests leave nothing running. hsm-fixtures/test.sh runs cargo test with HWKEY_TEST_RUN=RUN, which
# every process a test starts inherits (a proxy the exec plugin started through kubectl, a
# simulator, a server). Once cargo has finished, whatever still carries that value outlived its
# test: each is named, stopped (SIGTERM, SIGKILL 5 s later), and the exit status is 1.
set -uo pipefail
RUN=${1:?usage: outlived.sh RUN}
carriers() {
    local environ pid
    for environ in /proc/[0-9]*/environ; do
        pid=${environ#/proc/}
        pid=${pid%/environ}
        if tr '\0' '\n' 2>/dev/null <"$environ" | grep -qxF "HWKEY_TEST_RUN=$RUN"; then
            echo "$pid"
        fi
    done
}
left=$(carriers)
[[ -z "$left" ]] && exit 0
for pid in $left; do
    echo "test.sh: process $pid outlived the test that started it: $(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline")" >&2
    kill -TERM "$pid" 2>/dev/null
done
sleep 5
for pid in $(carriers); do
    kill -KILL "$pid" 2>/dev/null
done
exit 1
