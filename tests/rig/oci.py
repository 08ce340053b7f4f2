"""A one-layer OCI image archive from a few files, for the real node's own small images.

The node cannot pull (no registry is reachable), so its sandbox image (`pause`) and the
test image (`probe`) are written here from static binaries: an OCI image layout
(https://github.com/opencontainers/image-spec/blob/main/image-layout.md) in a tar, which
`ctr images import` reads. Everything is written deterministically (fixed times, sorted
entries), so the same files give the same image digest.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"


def _tar_bytes(entries: dict[str, tuple[bytes, int]]) -> bytes:
    """An uncompressed tar of `path -> (content, mode)`, parents included, fixed metadata."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({str(Path(p).parents[i]) for p in entries for i in range(len(Path(p).parents) - 1)})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for path, (content, mode) in sorted(entries.items()):
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(content), mode
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def _descriptor(media_type: str, blob: bytes) -> dict:
    return {"mediaType": media_type, "digest": "sha256:" + hashlib.sha256(blob).hexdigest(), "size": len(blob)}


def image_archive(name: str, files: dict[str, Path], entrypoint: list[str], out: Path) -> str:
    """Write an OCI archive of image `name` (`host/repo:tag`) holding `files`
    (`path in image -> file here`, executable) with `entrypoint`; return the manifest digest."""
    layer = _tar_bytes({dest.lstrip("/"): (src.read_bytes(), 0o755) for dest, src in files.items()})
    config = json.dumps({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": entrypoint, "Env": ["PATH=/"]},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }, sort_keys=True).encode()
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": _descriptor(MEDIA_CONFIG, config),
        "layers": [_descriptor(MEDIA_LAYER, layer)],
    }, sort_keys=True).encode()
    desc = _descriptor(MEDIA_MANIFEST, manifest) | {
        "platform": {"architecture": "amd64", "os": "linux"},
        # containerd names the imported image after this annotation.
        "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]},
    }
    index = json.dumps({"schemaVersion": 2, "manifests": [desc]}, sort_keys=True).encode()
    blobs = {f"blobs/sha256/{hashlib.sha256(b).hexdigest()}": (b, 0o644) for b in (layer, config, manifest)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(_tar_bytes({
        "oci-layout": (json.dumps({"imageLayoutVersion": "1.0.0"}).encode(), 0o644),
        "index.json": (index, 0o644),
        **blobs,
    }))
    tmp.replace(out)
    return desc["digest"]


def normalize(name: str) -> str:
    """A reference as containerd and the kubelet store it: `foo:1` is `docker.io/library/foo:1`."""
    first, _, rest = name.partition("/")
    if not rest:
        return f"docker.io/library/{name}"
    if "." in first or ":" in first or first == "localhost":
        return name
    return f"docker.io/{name}"


def archive_image_names(path: Path) -> list[str]:
    """The image names an archive carries: an OCI layout's index annotations or a
    docker-archive's RepoTags (`buildah push ... docker-archive:`), normalized."""
    with tarfile.open(path) as tar:
        members = {m.name.removeprefix("./"): m for m in tar.getmembers()}
        if "manifest.json" in members:  # docker-archive
            manifest = json.load(tar.extractfile(members["manifest.json"]))
            names = [tag for entry in manifest for tag in entry.get("RepoTags") or []]
        elif "index.json" in members:
            index = json.load(tar.extractfile(members["index.json"]))
            names = [m.get("annotations", {}).get("io.containerd.image.name") for m in index.get("manifests", [])]
        else:
            raise ValueError(f"{path} is neither a docker-archive nor an OCI archive")
    names = [normalize(n) for n in names if n]
    if not names:
        raise ValueError(f"{path} names no image (no RepoTags / io.containerd.image.name)")
    return names
