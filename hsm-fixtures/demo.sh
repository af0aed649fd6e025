#!/usr/bin/env bash
# Usage: hsm-fixtures/demo.sh
#
# The main job on an embedded default, from nothing: installs dependencies, builds hwkey, makes
# a SoftHSM token in a temporary directory, creates a P-256 key inside it, makes a CSR signed by
# the token, has a throw-away test CA issue the client certificate, stores it on the token, starts
# an mTLS server that requires and verifies client certificates (openssl s_server), and has
# `hwkey probe` talk to it with the handshake signed inside the token. Then it writes a
# kubeconfig with `hwkey kubeconfig` and runs kubectl with nothing else: the exec plugin starts
# `hwkey proxy`, and kubectl's requests reach the server over mTLS signed inside the token.
# Everything it starts is stopped and removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
hsm-fixtures/install-deps.sh
cargo build --release --locked
HWKEY="$PWD/target/release/hwkey"

WORK=$(mktemp -d -t hwkey-demo-XXXXXX)
SERVER_PID=""
cleanup() {
  [[ -n "$SERVER_PID" ]] && kill "$SERVER_PID" 2>/dev/null || true
  [[ -f "$WORK/state/proxy.pid" ]] && kill "$(cat "$WORK/state/proxy.pid")" 2>/dev/null || true
  sleep 0.2
  rm -rf "$WORK"
}
trap cleanup EXIT

step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }

step "SoftHSM token 'demo' in $WORK"
eval "$(hsm-fixtures/make-token.sh "$WORK/hsm" demo 2>/dev/null | tail -n 1)"
MODULE=/usr/lib/softhsm/libsofthsm2.so
KEY="pkcs11:token=demo;object=alice?module-path=$MODULE&pin-source=file:$WORK/hsm/pin"
echo "key URI: $KEY"

step "hwkey key create (EC P-256, sensitive, non-extractable)"
"$HWKEY" key create --key "$KEY" --algorithm ec-p256
"$HWKEY" key info --key "$KEY"

step "hwkey csr (signed inside the token)"
"$HWKEY" csr --key "$KEY" --subject "CN=alice,O=system:masters" --out "$WORK/alice.csr"
openssl req -in "$WORK/alice.csr" -verify -noout

step "test CA issues the client certificate; hwkey cert import stores it on the token"
hsm-fixtures/test-ca.sh "$WORK/ca" >/dev/null
hsm-fixtures/test-ca.sh sign "$WORK/ca" "$WORK/alice.csr" "$WORK/alice.crt" 1
"$HWKEY" cert import --key "$KEY" --cert "$WORK/alice.crt"
"$HWKEY" cert show --key "$KEY"

step "mTLS server (openssl s_server -Verify 1 -verify_return_error)"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
openssl s_server -accept "127.0.0.1:$PORT" -cert "$WORK/ca/server.pem" -key "$WORK/ca/server.key" \
  -CAfile "$WORK/ca/ca.pem" -Verify 1 -verify_return_error -www -tls1_3 >"$WORK/s_server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 50); do
  (echo >"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
  sleep 0.1
done

step "hwkey probe https://127.0.0.1:$PORT/ (CertificateVerify signed inside the token)"
"$HWKEY" probe --key "$KEY" --ca "$WORK/ca/ca.pem" "https://127.0.0.1:$PORT/" | grep -E 'Protocol|Cipher|Subject|CN' || true

step "hwkey kubeconfig: kubectl through the hwkey proxy"
"$HWKEY" kubeconfig --name demo --key "$KEY" --server "https://127.0.0.1:$PORT" \
  --ca "$WORK/ca/ca.pem" --out "$WORK/kubeconfig" --state-dir "$WORK/state" --idle-exit 1m
if command -v kubectl >/dev/null 2>&1; then
  # s_server -www answers every GET with its status page, which names the client certificate
  # it verified: the one whose key is in the token.
  kubectl --kubeconfig "$WORK/kubeconfig" get --raw / | grep -E 'Protocol|Subject:' || true
  echo "(kubectl started the proxy through 'hwkey credential'; its log: $WORK/state/proxy.log)"
else
  echo "kubectl is not installed: skipping the kubectl step of the demo (install kubectl >= 1.24)"
fi

step "done: the private key never left the token"
