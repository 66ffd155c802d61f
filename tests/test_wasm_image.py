"""The filter's OCI image: scripts/release.sh builds it without a Docker engine, it survives a
round trip through a real registry (Debian's docker-registry, run here as a plain process on
127.0.0.1), and what comes back is what Istio's and Envoy Gateway's Wasm fetchers accept:
the media types they look for, one plugin.wasm, and the very bytes that were built."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from harness import ROOT, WASM, free_port, wait_until

sys.path.insert(0, str(ROOT / "scripts"))
import oci_client  # noqa: E402
import wasm_image  # noqa: E402

REJECTED = "application/vnd.wasm.content.layer.v1+wasm"  # some tools' default; the fetchers refuse it


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def registry():
    """A docker-registry on 127.0.0.1 with its own config and storage, stopped afterwards."""
    binary = shutil.which("docker-registry") or "/usr/bin/docker-registry"
    assert os.path.exists(binary), "docker-registry is missing: run scripts/setup.sh (Debian package docker-registry)"
    work = tempfile.TemporaryDirectory(prefix="tb-registry-")
    port = free_port()
    config = Path(work.name) / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log: {level: error, accesslog: {disabled: true}}\n"
        f"storage: {{filesystem: {{rootdirectory: {work.name}/data}}}}\n"
        f"http: {{addr: 127.0.0.1:{port}}}\n")
    log = open(Path(work.name) / "registry.log", "w")
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    host = f"127.0.0.1:{port}"

    def up():
        if proc.poll() is not None:
            raise AssertionError(f"docker-registry exited: {(Path(work.name) / 'registry.log').read_text()[-2000:]}")
        return oci_client.Registry(host, plain_http=True, timeout=2).ping()

    try:
        wait_until(up, 20, "docker-registry to answer /v2/")
        yield host
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        work.cleanup()


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """scripts/release.sh run into a temporary dist folder (the .wasm is already built by
    scripts/setup.sh, so cargo has nothing to do)."""
    dist = tmp_path_factory.mktemp("dist")
    r = subprocess.run([str(ROOT / "scripts/release.sh")], cwd=ROOT, env={**os.environ, "TB_DIST": str(dist)},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    return dist


def fetcher_extract(manifest: dict, blobs: dict[str, bytes]) -> bytes:
    """The .wasm a fetcher that follows Istio's and Envoy Gateway's rules gets from an OCI
    image, or an AssertionError saying why it would refuse it: a single
    application/vnd.oci.image.layer.v1.tar+gzip layer whose tar holds plugin.wasm ("compat"),
    or exactly two layers of which one is application/vnd.module.wasm.content.layer.v1+wasm
    ("oci")."""
    layers = manifest["layers"]
    if len(layers) == 1:
        assert layers[0]["mediaType"] == wasm_image.OCI_LAYER_TAR_GZIP, layers[0]["mediaType"]
        with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blobs[layers[0]["digest"]]))) as tar:
            members = [m for m in tar.getmembers() if m.isfile()]
            plugin = [m for m in members if Path(m.name).name == wasm_image.PLUGIN_FILE]
            assert len(plugin) == 1, [m.name for m in members]
            return tar.extractfile(plugin[0]).read()
    assert len(layers) == 2, f"{len(layers)} layers"
    content = [d for d in layers if d["mediaType"] == wasm_image.WASM_CONTENT]
    assert len(content) == 1, [d["mediaType"] for d in layers]
    return blobs[content[0]["digest"]]


def test_release_writes_the_wasm_its_sha256_and_both_images(release):
    built = WASM.read_bytes()
    assert (release / "token_balancer.wasm").read_bytes() == built
    line = (release / "token_balancer.wasm.sha256").read_text().split()
    assert line == [sha256_hex(built), "token_balancer.wasm"]
    version = next(ln.split('"')[1] for ln in (ROOT / "Cargo.toml").read_text().splitlines()
                   if ln.startswith("version = "))
    images = dict((ln.split()[0], ln.split()[1:]) for ln in (release / "IMAGES").read_text().splitlines())
    assert set(images) == {"image-compat", "image-oci"}
    for name, (tag, digest) in images.items():
        assert tag == version
        index = json.loads((release / name / "index.json").read_text())
        assert index["manifests"][0]["digest"] == digest
        assert index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"] == version
        assert json.loads((release / name / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
        # Every blob of the layout is stored under its own digest.
        for blob in (release / name / "blobs/sha256").iterdir():
            assert sha256_hex(blob.read_bytes()) == blob.name


def test_images_are_reproducible(tmp_path):
    wasm = WASM.read_bytes()
    for variant in ("compat", "oci"):
        a = wasm_image.write_layout(wasm, tmp_path / f"{variant}-a", variant, "t", "1.2.3")
        b = wasm_image.write_layout(wasm, tmp_path / f"{variant}-b", variant, "t", "1.2.3")
        assert a.digest == b.digest
        files_a = sorted(p.name for p in (tmp_path / f"{variant}-a/blobs/sha256").iterdir())
        files_b = sorted(p.name for p in (tmp_path / f"{variant}-b/blobs/sha256").iterdir())
        assert files_a == files_b
    # The compat layer's tar entry carries no trace of who built it, or when.
    manifest, blobs = wasm_image.read_layout(tmp_path / "compat-a")
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blobs[manifest["layers"][0]["digest"]]))) as tar:
        (member,) = tar.getmembers()
        assert (member.name, member.mtime, member.uid, member.gid, member.uname, member.gname) == \
            ("plugin.wasm", 0, 0, 0, "", "")


@pytest.mark.parametrize("variant", ["compat", "oci"])
def test_registry_round_trip_gives_back_the_built_wasm(registry, release, variant):
    built = WASM.read_bytes()
    layout = release / f"image-{variant}"
    _, local_digest = (release / "IMAGES").read_text().split(f"image-{variant} ", 1)[1].split()[:2]
    ref = oci_client.Ref(registry, "token-balancer", f"{variant}-test")

    pushed = oci_client.push(layout, ref, plain_http=True)
    assert pushed == local_digest  # the digest a user puts in `sha256:` is the one the registry serves

    manifest, digest, blobs = oci_client.pull(ref, plain_http=True)
    assert digest == local_digest
    assert manifest["schemaVersion"] == 2
    assert manifest["mediaType"] == wasm_image.OCI_MANIFEST
    types = [manifest["config"]["mediaType"], *(d["mediaType"] for d in manifest["layers"])]
    assert REJECTED not in types
    if variant == "compat":
        assert manifest["config"]["mediaType"] == wasm_image.OCI_CONFIG
        assert [d["mediaType"] for d in manifest["layers"]] == [wasm_image.OCI_LAYER_TAR_GZIP]
        config = json.loads(blobs[manifest["config"]["digest"]])
        tar = gzip.decompress(blobs[manifest["layers"][0]["digest"]])
        assert config["rootfs"] == {"type": "layers", "diff_ids": ["sha256:" + sha256_hex(tar)]}
    else:
        assert manifest["config"]["mediaType"] == wasm_image.WASM_CONFIG
        assert [d["mediaType"] for d in manifest["layers"]] == [wasm_image.WASM_CONFIG, wasm_image.WASM_CONTENT]
        assert manifest["layers"][1]["digest"] == "sha256:" + sha256_hex(built)
        assert json.loads(blobs[manifest["config"]["digest"]])["rootIds"] == ["token_balancer", "token_balancer_poller"]

    plugin = fetcher_extract(manifest, blobs)
    assert sha256_hex(plugin) == sha256_hex(built)
    assert plugin[:4] == b"\0asm"


@pytest.mark.parametrize("variant", ["compat", "oci"])
def test_skopeo_copies_the_layout_as_it_is(registry, release, variant):
    """Another implementation of OCI layouts and of the distribution API (skopeo, what
    docs/DEPLOY.md pushes with) reads the layout and pushes it without changing a byte: the
    registry then serves the digest release.sh printed and the built plugin.wasm."""
    skopeo = shutil.which("skopeo")
    assert skopeo, "skopeo is missing: run scripts/setup.sh (Debian package skopeo)"
    tag, digest = (release / "IMAGES").read_text().split(f"image-{variant} ", 1)[1].split()[:2]
    ref = oci_client.Ref(registry, "token-balancer-skopeo", f"{variant}-{tag}")
    r = subprocess.run([skopeo, "copy", "--dest-tls-verify=false", f"oci:{release / f'image-{variant}'}:{tag}",
                        f"docker://{ref.host}/{ref.repo}:{ref.tag}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    manifest, served, blobs = oci_client.pull(ref, plain_http=True)
    assert served == digest
    assert sha256_hex(fetcher_extract(manifest, blobs)) == sha256_hex(WASM.read_bytes())


def test_a_layer_of_the_type_fetchers_refuse_is_refused(tmp_path):
    """The check above is not vacuous: the media type some tools write by default fails it."""
    wasm_image.write_layout(b"\0asm\1\0\0\0", tmp_path, "oci")
    manifest, blobs = wasm_image.read_layout(tmp_path)
    manifest["layers"][1]["mediaType"] = REJECTED
    with pytest.raises(AssertionError):
        fetcher_extract(manifest, blobs)


def test_license_file_image_and_crates_agree():
    """LICENSE is the license every crate declares, and the image says so too."""
    import re
    declared = {re.search(r'^license = "(.*)"$', p.read_text(), re.M).group(1)
                for p in [ROOT / "Cargo.toml", *ROOT.glob("core/Cargo.toml"), *ROOT.glob("examples/*/Cargo.toml")]}
    assert declared == {"Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text.splitlines()[0] and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not a notice
    manifest, _ = wasm_image.image_blobs(b"\0asm\1\0\0\0", "compat", "1.0.0")
    assert json.loads(manifest.data)["annotations"]["org.opencontainers.image.licenses"] == "Apache-2.0"
