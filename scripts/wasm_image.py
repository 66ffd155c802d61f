#!/usr/bin/env python3
"""Writes the filter's .wasm as an OCI image layout, with nothing but Python's standard library
(no Docker engine, no buildah). Two variants, both of which the Wasm image fetchers of Istio and
Envoy Gateway accept:

  compat  one layer, application/vnd.oci.image.layer.v1.tar+gzip, a tar holding plugin.wasm
          (an ordinary OCI image: any registry, any copy tool, Kubernetes image volumes)
  oci     exactly two layers: application/vnd.module.wasm.config.v1+json (a small JSON
          description) and application/vnd.module.wasm.content.layer.v1+wasm (the .wasm as it is)

Fetchers reject other media types some tools use by default (for example
application/vnd.wasm.content.layer.v1+wasm), so the types are fixed here.

The output is reproducible: the same .wasm gives byte-identical blobs and digests (tar entries
with fixed owner, mode and mtime, gzip with mtime 0, JSON with sorted keys and no timestamps).

Usage: scripts/wasm_image.py WASM OUT_DIR [--variant compat|oci] [--tag TAG] [--version V]
Writes OUT_DIR/oci-layout, OUT_DIR/index.json and OUT_DIR/blobs/sha256/*, and prints the
manifest digest (what `sha256:` fields of Istio and Envoy Gateway compare an image with).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_TAR_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
WASM_CONFIG = "application/vnd.module.wasm.config.v1+json"
WASM_CONTENT = "application/vnd.module.wasm.content.layer.v1+wasm"
PLUGIN_FILE = "plugin.wasm"


@dataclass(frozen=True)
class Blob:
    media_type: str
    data: bytes

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.data).hexdigest()

    def descriptor(self, annotations: dict | None = None) -> dict:
        d = {"mediaType": self.media_type, "digest": self.digest, "size": len(self.data)}
        if annotations:
            d["annotations"] = annotations
        return d


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def plugin_tar(wasm: bytes) -> bytes:
    """An uncompressed tar with one regular file, plugin.wasm, at the root: fixed metadata."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo(PLUGIN_FILE)
        info.size = len(wasm)
        info.mode = 0o444
        info.mtime = 0
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.type = tarfile.REGTYPE
        tar.addfile(info, io.BytesIO(wasm))
    return buf.getvalue()


def gzip_fixed(data: bytes) -> bytes:
    """gzip with no file name and mtime 0, so the same input gives the same bytes."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(data)
    return buf.getvalue()


def image_blobs(wasm: bytes, variant: str, version: str) -> tuple[Blob, list[Blob]]:
    """The manifest and every blob it names (config first, then the layers in order)."""
    annotations = {
        "org.opencontainers.image.title": "token-balancer",
        "org.opencontainers.image.description": "proxy-wasm filter for Envoy: LLM inference load balancing by tokens",
        "org.opencontainers.image.licenses": "Apache-2.0",
        "org.opencontainers.image.version": version,
    }
    if variant == "compat":
        tar = plugin_tar(wasm)
        layer = Blob(OCI_LAYER_TAR_GZIP, gzip_fixed(tar))
        config = Blob(OCI_CONFIG, canonical_json({
            "architecture": "wasm",
            "os": "wasip1",
            "config": {"Labels": {"org.opencontainers.image.version": version}},
            "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(tar).hexdigest()]},
        }))
        layers = [layer]
    elif variant == "oci":
        config = Blob(WASM_CONFIG, canonical_json({
            "type": "envoy_proxy",
            "abiVersions": ["proxy_abi_version_0_2_1"],
            "rootIds": ["token_balancer", "token_balancer_poller"],
        }))
        layers = [config, Blob(WASM_CONTENT, wasm)]
    else:
        raise ValueError(f"unknown variant {variant!r} (compat or oci)")
    manifest = Blob(OCI_MANIFEST, canonical_json({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": config.descriptor(),
        "layers": [b.descriptor() for b in layers],
        "annotations": annotations,
    }))
    return manifest, [config, *layers]


def write_layout(wasm: bytes, out: Path, variant: str = "compat", tag: str = "latest",
                 version: str = "0.0.0") -> Blob:
    """Writes the OCI image layout into `out` (created, or replaced if it is one already) and
    returns the manifest blob."""
    manifest, blobs = image_blobs(wasm, variant, version)
    blob_dir = out / "blobs" / "sha256"
    blob_dir.mkdir(parents=True, exist_ok=True)
    for old in blob_dir.iterdir():
        old.unlink()
    for b in [manifest, *blobs]:
        (blob_dir / b.digest.split(":", 1)[1]).write_bytes(b.data)
    (out / "oci-layout").write_bytes(canonical_json({"imageLayoutVersion": "1.0.0"}))
    index = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [manifest.descriptor({"org.opencontainers.image.ref.name": tag})],
    }
    (out / "index.json").write_bytes(canonical_json(index))
    return manifest


def read_layout(out: Path) -> tuple[dict, dict[str, bytes]]:
    """The manifest of a layout written by write_layout and every blob, by digest."""
    index = json.loads((out / "index.json").read_bytes())
    blobs = {"sha256:" + p.name: p.read_bytes() for p in (out / "blobs" / "sha256").iterdir()}
    manifest = json.loads(blobs[index["manifests"][0]["digest"]])
    return manifest, blobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wasm", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--variant", choices=["compat", "oci"], default="compat")
    ap.add_argument("--tag", default="latest")
    ap.add_argument("--version", default="0.0.0")
    args = ap.parse_args()
    manifest = write_layout(args.wasm.read_bytes(), args.out, args.variant, args.tag, args.version)
    print(manifest.digest)


if __name__ == "__main__":
    main()
