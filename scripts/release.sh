#!/usr/bin/env bash
# Builds what a release ships, into dist/ (ignored by git):
#   dist/token_balancer.wasm          the filter (wasm32-wasip1, release profile)
#   dist/token_balancer.wasm.sha256   its sha256, as `sha256sum` writes it (Envoy Gateway's HTTP
#                                     source and Envoy's remote code take this value)
#   dist/image-compat/                OCI image layout, one tar+gzip layer holding plugin.wasm
#   dist/image-oci/                   OCI image layout, the two-layer Wasm artifact variant
#   dist/IMAGES                       each image's manifest digest (Istio's and Envoy Gateway's
#                                     `sha256` of an image source take this value)
# Both images are accepted by Istio's and Envoy Gateway's Wasm fetchers and are reproducible
# (same .wasm, same digests). Needs rustup, cargo and python3; nothing else, no Docker engine.
# Push an image with scripts/oci_client.py (registries without login) or skopeo (any registry):
#   skopeo copy oci:dist/image-compat:VERSION docker://REGISTRY/token-balancer:VERSION
# Usage: scripts/release.sh        (TB_DIST=DIR writes elsewhere than dist/)
set -euo pipefail
cd "$(dirname "$0")/.."
dist="${TB_DIST:-dist}"
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n1)"

if ! rustup target list --installed | grep -qx wasm32-wasip1; then
  echo "release: adding the wasm32-wasip1 Rust target"
  rustup target add wasm32-wasip1
fi
echo "release: building token_balancer.wasm $version"
cargo build --quiet --release --target wasm32-wasip1 -p token-balancer
target_dir="${CARGO_TARGET_DIR:-target}"

mkdir -p "$dist"
cp "$target_dir/wasm32-wasip1/release/token_balancer.wasm" "$dist/token_balancer.wasm"
(cd "$dist" && sha256sum token_balancer.wasm > token_balancer.wasm.sha256)

: > "$dist/IMAGES"
for variant in compat oci; do
  digest="$(python3 scripts/wasm_image.py "$dist/token_balancer.wasm" "$dist/image-$variant" \
              --variant "$variant" --tag "$version" --version "$version")"
  echo "image-$variant $version $digest" >> "$dist/IMAGES"
done

echo "release: $dist/token_balancer.wasm sha256 $(cut -d' ' -f1 "$dist/token_balancer.wasm.sha256")"
sed 's/^/release: /' "$dist/IMAGES"
