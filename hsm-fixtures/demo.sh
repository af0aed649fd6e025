#!/usr/bin/env bash
# Usage: hsm-fixtures/demo.sh
#
# The main job on an embedded default, from nothing: installs dependencies, builds hwkey, makes
# a SoftHSM token in a temporary directory, creates a P-256 key inside it, makes a CSR signed by
# the token, has a throw-away test CA issue the client certificate, stores it on the token, starts
# an API server stand-in that requires and verifies client certificates and speaks HTTP/2 as
# kube-apiserver does (nginx), and has `hwkey probe` talk to it with the handshake signed inside
# the token. Then it writes a kubeconfig with `hwkey kubeconfig` and runs kubectl with nothing
# else: the exec plugin starts `hwkey proxy`, and kubectl's answer (which names the client
# certificate the server verified) arrives over mTLS signed inside the token. Any step that
# fails fails the demo.
# Everything it starts is stopped and removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
# HWKEY_BIN names an hwkey already built (the test suite runs the demo with its own build):
# then nothing is installed or built.
if [[ -n "${HWKEY_BIN:-}" ]]; then
  HWKEY=$HWKEY_BIN
else
  hsm-fixtures/install-deps.sh
  cargo build --release --locked
  HWKEY="$PWD/target/release/hwkey"
fi

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

step "mTLS API server stand-in (nginx: HTTP/2 and HTTP/1.1, ssl_verify_client on)"
# What an API server speaks: TLS 1.3 with a required client certificate, and HTTP/2 (kubectl
# asks for it). /version answers as kube-apiserver's does, naming the client certificate nginx
# verified: the one whose key is in the token.
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
mkdir -p "$WORK/nginx"
cat >"$WORK/nginx/nginx.conf" <<EOF
daemon off;
master_process off;
$([[ $(id -u) == 0 ]] && echo "user root;")
worker_processes 1;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/error.log;
events { worker_connections 64; }
http {
    access_log $WORK/nginx/access.log;
    client_body_temp_path $WORK/nginx/body;
    proxy_temp_path $WORK/nginx/proxy;
    fastcgi_temp_path $WORK/nginx/fastcgi;
    uwsgi_temp_path $WORK/nginx/uwsgi;
    scgi_temp_path $WORK/nginx/scgi;
    server {
        listen 127.0.0.1:$PORT ssl http2;
        ssl_certificate $WORK/ca/server.pem;
        ssl_certificate_key $WORK/ca/server.key;
        ssl_client_certificate $WORK/ca/ca.pem;
        ssl_verify_client on;
        ssl_protocols TLSv1.3;
        location / {
            default_type application/json;
            return 200 '{"gitVersion":"v1.0.0-hwkey-demo","clientCertificate":"\$ssl_client_s_dn","tls":"\$ssl_protocol","http":"\$server_protocol"}\n';
        }
    }
}
EOF
/usr/sbin/nginx -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" -e "$WORK/nginx/error.log" &
SERVER_PID=$!
for _ in $(seq 50); do
  (echo >"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
  sleep 0.1
done

step "hwkey probe https://127.0.0.1:$PORT/version (CertificateVerify signed inside the token)"
"$HWKEY" probe --key "$KEY" --ca "$WORK/ca/ca.pem" "https://127.0.0.1:$PORT/version"

step "hwkey kubeconfig: kubectl through the hwkey proxy"
"$HWKEY" kubeconfig --name demo --key "$KEY" --server "https://127.0.0.1:$PORT" \
  --ca "$WORK/ca/ca.pem" --out "$WORK/kubeconfig" --state-dir "$WORK/state" --idle-exit 1m
if ! command -v kubectl >/dev/null 2>&1; then
  echo "demo.sh: kubectl is not installed: install kubectl >= 1.24 (the machine image has it) and run again" >&2
  exit 1
fi
# kubectl runs `hwkey credential`, which starts the proxy; the proxy signs the upstream
# handshake inside the token. The answer must name alice's certificate, over HTTP/2.
ANSWER=$(kubectl --kubeconfig "$WORK/kubeconfig" get --raw /version)
echo "$ANSWER"
if ! grep -q 'CN=alice' <<<"$ANSWER" || ! grep -q '"http":"HTTP/2.0"' <<<"$ANSWER"; then
  echo "demo.sh: kubectl's answer does not name alice's certificate over HTTP/2; the proxy's log: $WORK/state/proxy.log" >&2
  cat "$WORK/state/proxy.log" >&2 || true
  exit 1
fi
echo "(kubectl started the proxy through 'hwkey credential'; its log: $WORK/state/proxy.log)"

step "done: the private key never left the token"
