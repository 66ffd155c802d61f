#!/usr/bin/env python3
"""A small client of the OCI distribution API (standard library only): pushes an OCI image
layout written by scripts/wasm_image.py to a registry and pulls an image back, checking every
digest. It speaks to registries that need no login (a registry on your machine or in your
cluster); for registries that need one, copy the layout with skopeo, which keeps the media types:
`skopeo copy oci:dist/image-compat:TAG docker://REGISTRY/REPO:TAG`.

Usage:
  scripts/oci_client.py push LAYOUT_DIR HOST[:PORT]/REPO:TAG [--plain-http]
  scripts/oci_client.py pull HOST[:PORT]/REPO:TAG OUT_DIR [--plain-http]
`push` prints the manifest digest the registry stored; `pull` writes the manifest and blobs.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wasm_image import OCI_INDEX, OCI_MANIFEST, read_layout  # noqa: E402

ACCEPT = ", ".join([OCI_MANIFEST, OCI_INDEX])


class RegistryError(Exception):
    pass


@dataclass(frozen=True)
class Ref:
    host: str
    repo: str
    tag: str

    @staticmethod
    def parse(text: str) -> "Ref":
        host, _, rest = text.partition("/")
        if not rest:
            raise ValueError(f"{text!r}: expected HOST[:PORT]/REPO:TAG")
        repo, _, tag = rest.rpartition(":")
        if not repo or "/" in tag:
            repo, tag = rest, "latest"
        return Ref(host, repo, tag)


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Registry:
    def __init__(self, host: str, plain_http: bool = False, timeout: float = 30.0):
        self.host = host
        self.plain_http = plain_http
        self.timeout = timeout

    def _request(self, method: str, path: str, body: bytes | None = None,
                 headers: dict | None = None) -> tuple[int, dict, bytes]:
        cls = http.client.HTTPConnection if self.plain_http else http.client.HTTPSConnection
        conn = cls(self.host, timeout=self.timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def ping(self) -> bool:
        status, _, _ = self._request("GET", "/v2/")
        return status == 200

    def has_blob(self, repo: str, digest: str) -> bool:
        status, _, _ = self._request("HEAD", f"/v2/{repo}/blobs/{digest}")
        return status == 200

    def push_blob(self, repo: str, data: bytes) -> str:
        digest = sha256(data)
        if self.has_blob(repo, digest):
            return digest
        status, headers, body = self._request("POST", f"/v2/{repo}/blobs/uploads/",
                                              headers={"Content-Length": "0"})
        if status != 202 or "location" not in headers:
            raise RegistryError(f"starting an upload to {repo}: HTTP {status} {body[:200]!r}")
        loc = urllib.parse.urlsplit(headers["location"])
        query = urllib.parse.parse_qsl(loc.query) + [("digest", digest)]
        path = loc.path + "?" + urllib.parse.urlencode(query)
        status, _, body = self._request("PUT", path, body=data, headers={
            "Content-Type": "application/octet-stream", "Content-Length": str(len(data))})
        if status != 201:
            raise RegistryError(f"uploading blob {digest}: HTTP {status} {body[:200]!r}")
        return digest

    def push_manifest(self, repo: str, tag: str, manifest: bytes, media_type: str) -> str:
        status, headers, body = self._request("PUT", f"/v2/{repo}/manifests/{tag}", body=manifest,
                                              headers={"Content-Type": media_type})
        if status != 201:
            raise RegistryError(f"putting manifest {repo}:{tag}: HTTP {status} {body[:300]!r}")
        return headers.get("docker-content-digest", sha256(manifest))

    def get_manifest(self, repo: str, reference: str) -> tuple[bytes, str, str]:
        """The manifest's bytes, its media type and the digest the registry gives it."""
        status, headers, body = self._request("GET", f"/v2/{repo}/manifests/{reference}",
                                              headers={"Accept": ACCEPT})
        if status != 200:
            raise RegistryError(f"getting manifest {repo}:{reference}: HTTP {status} {body[:200]!r}")
        return body, headers.get("content-type", ""), headers.get("docker-content-digest", "")

    def get_blob(self, repo: str, digest: str) -> bytes:
        path = f"/v2/{repo}/blobs/{digest}"
        for _ in range(3):  # a registry may redirect to its storage
            status, headers, body = self._request("GET", path)
            if status in (301, 302, 303, 307, 308) and "location" in headers:
                loc = urllib.parse.urlsplit(headers["location"])
                if loc.netloc and loc.netloc != self.host:
                    raise RegistryError(f"blob {digest} redirects to another host: {loc.netloc}")
                path = loc.path + ("?" + loc.query if loc.query else "")
                continue
            break
        if status != 200:
            raise RegistryError(f"getting blob {digest}: HTTP {status}")
        if sha256(body) != digest:
            raise RegistryError(f"blob {digest} arrived with digest {sha256(body)}")
        return body


def push(layout: Path, ref: Ref, plain_http: bool = False) -> str:
    """Pushes the layout's blobs, then its manifest under ref.tag; returns the registry's digest
    of the manifest."""
    manifest, blobs = read_layout(layout)
    reg = Registry(ref.host, plain_http)
    for desc in [manifest["config"], *manifest["layers"]]:
        data = blobs[desc["digest"]]
        if len(data) != desc["size"] or sha256(data) != desc["digest"]:
            raise RegistryError(f"layout blob {desc['digest']} does not match its descriptor")
        reg.push_blob(ref.repo, data)
    index = json.loads((layout / "index.json").read_bytes())
    raw = blobs[index["manifests"][0]["digest"]]
    return reg.push_manifest(ref.repo, ref.tag, raw, manifest.get("mediaType", OCI_MANIFEST))


def pull(ref: Ref, plain_http: bool = False) -> tuple[dict, str, dict[str, bytes]]:
    """The manifest, the digest the registry gives it, and every blob it names, each checked."""
    reg = Registry(ref.host, plain_http)
    raw, media_type, digest = reg.get_manifest(ref.repo, ref.tag)
    if digest and digest != sha256(raw):
        raise RegistryError(f"manifest digest {digest} does not match its bytes ({sha256(raw)})")
    manifest = json.loads(raw)
    if media_type and manifest.get("mediaType") and media_type != manifest["mediaType"]:
        raise RegistryError(f"manifest served as {media_type}, declares {manifest['mediaType']}")
    blobs = {}
    for desc in [manifest["config"], *manifest["layers"]]:
        blobs[desc["digest"]] = reg.get_blob(ref.repo, desc["digest"])
    return manifest, digest or sha256(raw), blobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("push")
    p.add_argument("layout", type=Path)
    p.add_argument("ref")
    p.add_argument("--plain-http", action="store_true", help="HTTP instead of HTTPS (a local registry)")
    q = sub.add_parser("pull")
    q.add_argument("ref")
    q.add_argument("out", type=Path)
    q.add_argument("--plain-http", action="store_true")
    args = ap.parse_args()
    if args.cmd == "push":
        print(push(args.layout, Ref.parse(args.ref), args.plain_http))
    else:
        manifest, digest, blobs = pull(Ref.parse(args.ref), args.plain_http)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2))
        for d, data in blobs.items():
            (args.out / d.replace(":", "_")).write_bytes(data)
        print(digest)


if __name__ == "__main__":
    main()
