#!/usr/bin/env bash
# Builds the CUDA release of dflash-serve and packs it with the demo assets, the systemd unit and
# a README into one tarball (deploy/release/README.md says what is inside and what it needs).
#
#   deploy/release/build.sh                       CUDA 13.0 build (sm_90), then package
#   deploy/release/build.sh --binary PATH --variant NAME
#                                                 package an already built binary instead
#                                                 (deploy/release/check.sh packages the CPU
#                                                 debug build this way in CI)
# Options: --out DIR (default dist/), --allow-dirty (package uncommitted changes; the name then
# says -dirty). The CUDA build uses the toolchain script's approach: CUDA_TOOLCHAIN (default
# ../shared/tools/cuda-toolchain.sh) installs nvcc, headers and libraries from wheels, no GPU
# needed; the build goes to CARGO_TARGET_DIR (default target-cuda) with --locked.
# Reproducible: from a clean checkout of one commit, the same binary always gives a
# byte-identical tarball (sorted names, fixed owner, mtimes at the commit's time, gzip -n).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
BINARY= VARIANT= OUT=dist ALLOW_DIRTY= BUILT_HERE=
while [ $# -gt 0 ]; do
  case $1 in
    --binary) BINARY=$2; shift 2 ;;
    --variant) VARIANT=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --allow-dirty) ALLOW_DIRTY=1; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
fail() { echo "release: $*" >&2; exit 1; }
for tool in git tar gzip sha256sum readelf strip; do
  command -v $tool >/dev/null || fail "$tool not found"
done

COMMIT=$(git rev-parse --short=12 HEAD)
EPOCH=$(git log -1 --format=%ct HEAD)
DIRTY=
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  [ -n "$ALLOW_DIRTY" ] || fail "the checkout has uncommitted changes; commit them (a release is built from a clean checkout) or pass --allow-dirty"
  DIRTY=-dirty
fi

if [ -z "$BINARY" ]; then
  TOOLCHAIN=${CUDA_TOOLCHAIN:-$ROOT/../shared/tools/cuda-toolchain.sh}
  [ -f "$TOOLCHAIN" ] || fail "no CUDA toolchain script at $TOOLCHAIN (set CUDA_TOOLCHAIN)"
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-cuda}
  # Fetch first: the toolchain script builds its libcuda link stub from cudarc's sources.
  cargo fetch --locked
  # shellcheck source=/dev/null
  source "$TOOLCHAIN" || fail "the CUDA toolchain script failed"
  command -v nvcc >/dev/null || fail "nvcc not on PATH after sourcing $TOOLCHAIN"
  nice cargo build --release --locked --features cuda -p dflash-serve
  BINARY=$CARGO_TARGET_DIR/release/dflash-serve
  BUILT_HERE=1
  VARIANT=${VARIANT:-cuda13.0-sm${CUDA_COMPUTE_CAP}}
fi
[ -n "$VARIANT" ] || fail "--variant is needed with --binary (e.g. cpu, cuda13.0-sm90)"
[ -x "$BINARY" ] || fail "no executable at $BINARY"
NEEDED=$(readelf -d "$BINARY" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort)
case $VARIANT in
  cuda*) grep -qx 'libcuda.so.1' <<<"$NEEDED" || fail "$BINARY does not link libcuda.so.1: not a CUDA build, but --variant is $VARIANT" ;;
  *) ! grep -q '^libcu' <<<"$NEEDED" || fail "$BINARY links CUDA libraries, but --variant is $VARIANT" ;;
esac
VERSION=$("$BINARY" --version | awk '{print $2}')
[ -n "$VERSION" ] || fail "$BINARY --version printed no version"

NAME=dflash-serve-$VERSION-g$COMMIT$DIRTY-$VARIANT-$(uname -m)-linux
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
DIR=$STAGE/$NAME
mkdir -p "$DIR/assets" "$DIR/systemd"
cp "$BINARY" "$DIR/dflash-serve"
strip --strip-unneeded "$DIR/dflash-serve"
# The demo pair, next to the binary, where the server looks when it is not run from a checkout.
git ls-files -z serve/assets | while IFS= read -r -d '' f; do
  mkdir -p "$DIR/assets/$(dirname "${f#serve/assets/}")"
  cp "$f" "$DIR/assets/${f#serve/assets/}"
done
[ -f "$DIR/assets/tiny-coder-demo/config.json" ] && [ -f "$DIR/assets/tiny-coder-demo-dflash/config.json" ] \
  || fail "the demo assets are missing from serve/assets"
cp deploy/release/README.md "$DIR/README.md"
cp deploy/systemd/dflash-serve.service deploy/systemd/dflash-serve.env "$DIR/systemd/"
{
  echo "name: $NAME"
  echo "version: $VERSION"
  echo "commit: $(git rev-parse HEAD)$DIRTY"
  echo "commit_time: $(date -u -d "@$EPOCH" +%Y-%m-%dT%H:%M:%SZ)"
  echo "variant: $VARIANT"
  [ -n "${CUDA_COMPUTE_CAP:-}" ] && [ "${VARIANT#cuda}" != "$VARIANT" ] && echo "cuda_compute_cap: $CUDA_COMPUTE_CAP"
  [ "${VARIANT#cuda}" != "$VARIANT" ] && command -v nvcc >/dev/null && echo "nvcc: $(nvcc --version | tail -1)"
  if [ -n "$BUILT_HERE" ]; then
    echo "built: cargo build --release --locked --features cuda -p dflash-serve"
    echo "rustc: $(rustc --version)"
  else
    echo "built: elsewhere (packaged with --binary)"
  fi
  echo "glibc_required: $(objdump -T "$DIR/dflash-serve" 2>/dev/null | grep -oE 'GLIBC_[0-9.]+' | sort -V -u | tail -1)"
  echo "shared_libraries:"
  sed 's/^/  - /' <<<"$NEEDED"
} > "$DIR/BUILD-INFO"
(cd "$DIR" && find . -type f ! -name SHA256SUMS -print0 | LC_ALL=C sort -z | xargs -0 sha256sum > SHA256SUMS)

mkdir -p "$OUT"
TARBALL=$OUT/$NAME.tar.gz
find "$DIR" -exec touch -h -d "@$EPOCH" {} +
LC_ALL=C tar --sort=name --format=gnu --owner=0 --group=0 --numeric-owner \
  --mode='u+rwX,go+rX,go-w' --mtime="@$EPOCH" -C "$STAGE" -cf - "$NAME" | gzip -n -9 > "$TARBALL"
(cd "$OUT" && sha256sum "$NAME.tar.gz" > "$NAME.tar.gz.sha256")
echo "$TARBALL ($(( $(stat -c %s "$TARBALL") / 1024 / 1024 )) MiB): $(cut -d' ' -f1 "$TARBALL.sha256")"
