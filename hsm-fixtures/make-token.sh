#!/usr/bin/env bash
# Usage: hsm-fixtures/make-token.sh DIR LABEL [USER_PIN] [SO_PIN]
#
# Creates a private SoftHSMv2 setup in DIR: DIR/softhsm2.conf (from
# softhsm-config/softhsm2.conf.template, tokens in DIR/tokens), initializes a token named
# LABEL in the first free slot, and writes the user PIN to DIR/pin (mode 0600, no newline).
# USER_PIN defaults to 1234, SO_PIN to 12345678. Prints the line to eval:
#   eval "$(hsm-fixtures/make-token.sh /tmp/hsm mytoken)"
set -euo pipefail

if (($# < 2 || $# > 4)); then
  sed -n '2,9s/^# \{0,1\}//p' "$0" >&2
  exit 2
fi

DIR=$1
LABEL=$2
USER_PIN=${3:-1234}
SO_PIN=${4:-12345678}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TEMPLATE="$HERE/../softhsm-config/softhsm2.conf.template"

mkdir -p "$DIR/tokens"
DIR=$(cd "$DIR" && pwd)
CONF="$DIR/softhsm2.conf"

# Escape sed's special characters in the replacement (\\, & and the | delimiter).
TOKENDIR_ESCAPED=$(printf '%s' "$DIR/tokens" | sed 's/[\\&|]/\\&/g')
sed "s|@TOKENDIR@|$TOKENDIR_ESCAPED|" "$TEMPLATE" >"$CONF"

SOFTHSM2_CONF="$CONF" softhsm2-util --init-token --free --label "$LABEL" \
  --so-pin "$SO_PIN" --pin "$USER_PIN" >&2

(
  umask 077
  printf '%s' "$USER_PIN" >"$DIR/pin"
)
chmod 0600 "$DIR/pin"

printf 'export SOFTHSM2_CONF=%q\n' "$CONF"
