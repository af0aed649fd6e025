#!/usr/bin/env bash
# Usage: hsm-fixtures/test-ca.sh DIR
#        hsm-fixtures/test-ca.sh sign DIR CSR OUT [DAYS]
#
# First form: creates a throw-away test CA (EC P-256, CA:TRUE, keyCertSign) in DIR/ca.pem +
# DIR/ca.key, and a server certificate DIR/server.pem + DIR/server.key for DNS:localhost and
# IP:127.0.0.1 (serverAuth), signed by that CA. An existing CA in DIR is kept.
# Second form: signs the client CSR file CSR with the CA in DIR and writes the certificate to
# OUT: clientAuth, digitalSignature, the CSR's subject and its subjectAltName (if any), valid
# for DAYS days (default 30). The CSR's signature is checked first.
# Software keys only: this CA exists for tests and demos, never for production.
set -euo pipefail

usage() {
  sed -n '2,12s/^# \{0,1\}//p' "$0" >&2
  exit 2
}

write_config() {
  local cnf=$1
  cat >"$cnf" <<'CNF'
[req]
distinguished_name = req_dn
prompt = no

[req_dn]
CN = hwkey test CA

[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash

[server_ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost, IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid

[client_ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
CNF
}

random_serial() {
  echo "0x$(openssl rand -hex 16)"
}

make_ca() {
  local dir=$1
  mkdir -p "$dir"
  write_config "$dir/openssl.cnf"
  if [[ -f "$dir/ca.pem" && -f "$dir/ca.key" ]]; then
    echo "test-ca: keeping existing CA in $dir" >&2
  else
    (
      umask 077
      openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$dir/ca.key"
    )
    openssl req -x509 -new -config "$dir/openssl.cnf" -extensions v3_ca \
      -key "$dir/ca.key" -sha256 -days 3650 -set_serial "$(random_serial)" -out "$dir/ca.pem"
  fi
  (
    umask 077
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$dir/server.key"
  )
  openssl req -new -config "$dir/openssl.cnf" -key "$dir/server.key" -subj "/CN=localhost" \
    -out "$dir/server.csr"
  openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
    -sha256 -days 365 -set_serial "$(random_serial)" \
    -extfile "$dir/openssl.cnf" -extensions server_ext -out "$dir/server.pem" 2>/dev/null
  rm -f "$dir/server.csr"
  openssl verify -CAfile "$dir/ca.pem" "$dir/server.pem" >/dev/null
  echo "test-ca: CA $dir/ca.pem, server cert $dir/server.pem (key $dir/server.key)" >&2
}

sign_csr() {
  local dir=$1 csr=$2 out=$3 days=${4:-30}
  if [[ ! -f "$dir/ca.pem" || ! -f "$dir/ca.key" ]]; then
    echo "test-ca: no CA in $dir; run: $0 $dir" >&2
    exit 1
  fi
  [[ -f "$dir/openssl.cnf" ]] || write_config "$dir/openssl.cnf"
  openssl req -in "$csr" -noout -verify 2>/dev/null || {
    echo "test-ca: $csr is not a CSR with a valid signature" >&2
    exit 1
  }
  # -copy_extensions copy + -ext subjectAltName: take only the SANs from the CSR; every
  # other extension comes from [client_ext].
  openssl x509 -req -in "$csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
    -sha256 -days "$days" -set_serial "$(random_serial)" \
    -copy_extensions copy -ext subjectAltName \
    -extfile "$dir/openssl.cnf" -extensions client_ext -out "$out" 2>/dev/null
  openssl verify -CAfile "$dir/ca.pem" -purpose sslclient "$out" >/dev/null
  echo "test-ca: signed $out" >&2
}

case "${1:-}" in
  sign)
    (($# == 4 || $# == 5)) || usage
    sign_csr "$2" "$3" "$4" "${5:-30}"
    ;;
  "" | -h | --help)
    usage
    ;;
  *)
    (($# == 1)) || usage
    make_ca "$1"
    ;;
esac
