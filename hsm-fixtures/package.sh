#!/usr/bin/env bash
# Usage: hsm-fixtures/package.sh
#
# Builds what operators install, from this checkout:
#   target/package/hwkey_VERSION-1_ARCH.deb   the Debian package (cargo deb, metadata in
#                                             Cargo.toml), checked by lintian
#   target/package/hwkey-approver/            the approver's OCI image (an OCI layout, tag
#                                             VERSION), built with umoci, no Docker daemon
# and prints their paths. Push the image with
#   skopeo copy oci:target/package/hwkey-approver:VERSION docker://REGISTRY/hwkey-approver:VERSION
# The tests that install the package into a clean Debian root and run the image under runc
# (tests/it/shipping/clean_root.rs, tests/it/shipping/approver_image.rs) use these files; hsm-fixtures/test.sh runs
# this script first.
set -euo pipefail
cd "$(dirname "$0")/.."
hsm-fixtures/install-deps.sh >&2
CARGO_DEB=$(hsm-fixtures/install-cargo-tool.sh cargo-deb 3.8.0)

VERSION=$(cargo metadata --locked --no-deps --format-version 1 |
  python3 -c 'import json,sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"] == "hwkey"))')
# The package goes into the checkout's target/package (Cargo.toml's asset paths); the build
# into Cargo's target directory, which CI keeps outside the clone (.ci/run: CARGO_TARGET_DIR).
# cargo deb reads its target/release/ assets from there too.
OUT=target/package
GEN=$OUT/gen
RELEASE=${CARGO_TARGET_DIR:-target}/release
echo "package.sh: release build of hwkey $VERSION" >&2
cargo build --release --locked --bins

# Dates inside the package and the image come from the commit, so two packagings of one build
# are alike. (Exported after the build: the C parts of ring and aws-lc rebuild when it changes.)
SOURCE_DATE_EPOCH=$(git log -1 --format=%ct 2>/dev/null || date +%s)
export SOURCE_DATE_EPOCH

rm -rf "$GEN"
mkdir -p "$GEN/man" "$GEN/completions"
"$RELEASE/hwkey" man --out "$GEN/man" 2>/dev/null
"$RELEASE/hwkey" completions bash >"$GEN/completions/hwkey"
"$RELEASE/hwkey" completions zsh >"$GEN/completions/_hwkey"
"$RELEASE/hwkey" completions fish >"$GEN/completions/hwkey.fish"
# Debian's changelog for this build; the project's history is CHANGELOG.md (shipped as
# /usr/share/doc/hwkey/changelog.gz).
cat >"$GEN/changelog.Debian" <<EOF
hwkey ($VERSION-1) unstable; urgency=medium

  * Package of hwkey $VERSION (commit $(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)).
    The changes are in /usr/share/doc/hwkey/changelog.gz.

 -- hwkey developers <hwkey@example.org>  $(date -R -u -d "@$SOURCE_DATE_EPOCH")
EOF
cp CHANGELOG.md "$GEN/changelog"

echo "package.sh: cargo deb" >&2
rm -f "$OUT"/hwkey_*.deb
"$CARGO_DEB" --no-build --no-strip --locked --quiet -o "$OUT/" >&2
DEB=$(ls "$OUT"/hwkey_"$VERSION"-1_*.deb)
# Errors and warnings fail the build; every override is in debian/lintian-overrides, with why.
echo "package.sh: lintian $DEB" >&2
lintian --fail-on error,warning --allow-root "$DEB" >&2

# The approver's image: the hwkey binary, the shared libraries it links (as ldd resolves them
# on this machine, the same Debian 12 the package is for), the CA certificates, and a passwd
# entry for the non-root user it runs as. No shell, no package manager.
IMAGE=$OUT/hwkey-approver
ROOTFS=$OUT/approver-rootfs
rm -rf "$IMAGE" "$ROOTFS"
install -D -m 0755 "$RELEASE/hwkey" "$ROOTFS/usr/bin/hwkey"
ldd "$RELEASE/hwkey" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' |
  while read -r lib; do
    # With the file's own mode: the dynamic loader must stay executable.
    real=$(readlink -f "$lib")
    install -D -m "$(stat -c %a "$real")" "$real" "$ROOTFS$lib"
  done
# The CA certificates come from a pinned Debian package (version and checksum below), not from
# whatever this build host has: the same image from any machine. Downloaded once per machine.
CA_DEB_VERSION=20250419~deb12u2
CA_DEB_SHA256=b9f76b5271a7ac373fd5e7e1b5b826a71ddd702b42a0d104955ecb1acfffc94b
CA_CACHE=${HWKEY_CACHE:-/var/cache/hwkey}/ca-certificates
CA_DEB="$CA_CACHE/ca-certificates_${CA_DEB_VERSION}_all.deb"
if [[ ! -f "$CA_DEB" ]] || ! echo "$CA_DEB_SHA256  $CA_DEB" | sha256sum -c --quiet - 2>/dev/null; then
  mkdir -p "$CA_CACHE"
  (cd "$CA_CACHE" && apt-get download "ca-certificates=$CA_DEB_VERSION" >&2) || {
    echo "package.sh: cannot download ca-certificates $CA_DEB_VERSION: update CA_DEB_VERSION and CA_DEB_SHA256 in $0 to the version Debian 12 carries now" >&2
    exit 1
  }
  echo "$CA_DEB_SHA256  $CA_DEB" | sha256sum -c --quiet - || {
    echo "package.sh: $CA_DEB does not have the pinned checksum" >&2
    exit 1
  }
fi
CA_X=$(mktemp -d)
dpkg-deb -x "$CA_DEB" "$CA_X"
find "$CA_X/usr/share/ca-certificates/mozilla" -name '*.crt' -print0 | sort -z | xargs -0 cat >"$CA_X/bundle.crt"
install -D -m 0644 "$CA_X/bundle.crt" "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
rm -rf "$CA_X"
printf 'root:x:0:0:root:/:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/:/sbin/nologin\n' >"$ROOTFS/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' >"$ROOTFS/etc/group"
chmod 0644 "$ROOTFS/etc/passwd" "$ROOTFS/etc/group"
install -d -m 1777 "$ROOTFS/tmp"
find "$ROOTFS" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +

echo "package.sh: OCI image $IMAGE:$VERSION (umoci)" >&2
COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
CREATED=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
umoci init --layout "$IMAGE"
umoci new --image "$IMAGE:$VERSION"
umoci insert --image "$IMAGE:$VERSION" --history.created "$CREATED" \
  --history.created_by "hsm-fixtures/package.sh" "$ROOTFS" /
umoci config --image "$IMAGE:$VERSION" --created "$CREATED" --history.created "$CREATED" \
  --author "hwkey developers" --os linux --architecture "$(dpkg --print-architecture)" \
  --config.user 65532:65532 --config.workingdir / \
  --config.entrypoint /usr/bin/hwkey --config.cmd approver --config.cmd --help \
  --config.env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
  --config.label "org.opencontainers.image.title=hwkey-approver" \
  --config.label "org.opencontainers.image.version=$VERSION" \
  --config.label "org.opencontainers.image.revision=$COMMIT" \
  --config.label "org.opencontainers.image.licenses=Apache-2.0"
umoci gc --layout "$IMAGE"
rm -rf "$ROOTFS"

echo "DEB=$DEB"
echo "IMAGE=$IMAGE:$VERSION"
echo "IMAGE_BYTES=$(du -sb "$IMAGE/blobs" | cut -f1)"
