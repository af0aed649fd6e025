#!/usr/bin/env bash
# Usage: hsm-fixtures/install-deps.sh
#
# Installs what hwkey's build and tests need on Debian/Ubuntu: SoftHSMv2, swtpm, the TSS2
# libraries and tools, OpenSC (pkcs11-tool), tpm2-openssl, nginx-light, clang, pkg-config,
# openssl, curl, p11-kit (its proxy module), tpm2-abrmd with D-Bus (a shared TPM) and a C
# toolchain with pkcs11.h (libp11-kit-dev: a session-limited test module), and what packaging
# and its tests use (lintian, umoci, runc, mmdebstrap: hsm-fixtures/package.sh), strace (a test counts the
# proxy's thread wake-ups) and util-linux-extra (fincore: the benches' check that the binaries they
# run leave the page cache). Idempotent: when every package is already installed it
# changes nothing. Uses sudo only when not running as root.
#
# It never installs Debian's `kubernetes-client`: that kubectl (1.20) knows no
# client.authentication.k8s.io/v1 and would shadow the newer kubectl of the machine image.
set -euo pipefail

PACKAGES=(
  softhsm2 swtpm swtpm-tools libtss2-dev libtss2-tcti-swtpm0 tpm2-tools tpm2-openssl
  opensc nginx-light clang pkg-config openssl curl ca-certificates build-essential
  python3 python3-prometheus-client p11-kit p11-kit-modules tpm2-abrmd libtss2-tcti-tabrmd0 dbus
  libtpm2-pkcs11-1 libtpm2-pkcs11-tools libp11-kit-dev squid dante-server iptables man-db
  lintian umoci runc mmdebstrap bash-completion strace systemd util-linux-extra
)

is_installed() {
  [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true)" == "install ok installed" ]]
}

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! is_installed "$pkg"; then
    missing+=("$pkg")
  fi
done

if ((${#missing[@]} > 0)); then
  SUDO=()
  if [[ "$(id -u)" -ne 0 ]]; then
    if ! command -v sudo >/dev/null 2>&1; then
      echo "install-deps: not root and sudo is missing; install as root: ${missing[*]}" >&2
      exit 1
    fi
    SUDO=(sudo)
  fi
  echo "install-deps: installing ${missing[*]}" >&2
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
  # Install only the named packages; kubernetes-client is never among them.
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y --no-install-recommends "${missing[@]}"
else
  echo "install-deps: all packages already installed" >&2
fi

# Commands the tests run; a package can be installed and still be broken or incomplete.
for cmd in softhsm2-util swtpm swtpm_setup tpm2_getrandom pkcs11-tool openssl curl clang pkg-config fincore; do
  if ! command -v "$cmd" >/dev/null 2>&1; then
    echo "install-deps: '$cmd' is still not on PATH after installing packages" >&2
    exit 1
  fi
done
if [[ ! -x /usr/sbin/nginx ]]; then
  echo "install-deps: /usr/sbin/nginx is missing (package nginx-light)" >&2
  exit 1
fi
if [[ ! -e /usr/lib/softhsm/libsofthsm2.so ]]; then
  echo "install-deps: /usr/lib/softhsm/libsofthsm2.so is missing (package softhsm2)" >&2
  exit 1
fi

if ! command -v cargo >/dev/null 2>&1; then
  cat >&2 <<'MSG'
install-deps: cargo is not installed. Install Rust with rustup:
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y
  . "$HOME/.cargo/env"
MSG
  exit 1
fi
