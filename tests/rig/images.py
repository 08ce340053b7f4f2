"""Build kiln's container images from images/*/Dockerfile, without a Docker daemon.

No registry but the package registries is reachable here, so the one base image the Dockerfiles
name, ``debian:bookworm-slim``, is made from Debian's packages (``mmdebstrap --variant=minbase``,
slimmed like Docker's official image) and committed under that same name into a private buildah
store; then ``buildah bud --pull=never`` builds each Dockerfile as it is, and ``buildah push``
writes a docker-archive tar that ``ctr images import`` (the rig's real node) loads.

Everything is cached under ``$KILN_CACHE_DIR/images``: the buildah store (with its intermediate
layers: a kiln source change rebuilds only kiln's own layer), pip's cache mount (torch and its
nvidia-* wheels are downloaded once), and one archive per image named by a hash of everything that
goes into it (Dockerfile, ignore file, build context files, base recipe, build arguments).

``python -m tests.rig.images`` builds what is missing and prints the archives; docs/rig.md, "Images".
"""

from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.rig import build

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"

# The base the Dockerfiles name, made locally from Debian: minbase plus the path filters of Docker's
# "slim" variant (debuerreotype --slimify): no man pages, docs (but copyrights), info or locales.
BASE_NAME = "docker.io/library/debian:bookworm-slim"
BASE_RECIPE = {
    "suite": "bookworm",
    "variant": "minbase",
    "sources": [
        "deb http://deb.debian.org/debian bookworm main",
        "deb http://deb.debian.org/debian bookworm-updates main",
        "deb http://deb.debian.org/debian-security bookworm-security main",
    ],
    "dpkg": [
        "path-exclude=/usr/share/man/*",
        "path-exclude=/usr/share/info/*",
        "path-exclude=/usr/share/locale/*",
        "path-include=/usr/share/locale/locale.alias",
        "path-exclude=/usr/share/doc/*",
        "path-include=/usr/share/doc/*/copyright",
        "path-exclude=/usr/share/lintian/*",
    ],
    "config": {"cmd": '["bash"]', "env": "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
}
# Debian packages this module runs: executable -> package.
TOOLS = {"mmdebstrap": "mmdebstrap", "buildah": "buildah", "fuse-overlayfs": "fuse-overlayfs"}


def cache_dir() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR") or REPO / ".cache") / "images"


def log(msg: str) -> None:
    print(f"[rig images {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def image_refs() -> dict[str, str]:
    """The names the chart (operator) and the plan (trainer, kiln.control.config.DEFAULT_IMAGE) run."""
    values = yaml.safe_load((REPO / "helm/kiln/values.yaml").read_text())
    chart = yaml.safe_load((REPO / "helm/kiln/Chart.yaml").read_text())
    operator = f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"
    return {"operator": operator, "trainer": values["trainer"]["image"]}


def build_args() -> dict[str, str]:
    return {"KILN_VERSION": tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]}


# --- the build context: what COPY can see, by the image's own ignore file --------------------------

def ignore_file(name: str) -> Path:
    # BuildKit reads <Dockerfile>.dockerignore next to the Dockerfile; buildah gets it by --ignorefile.
    return IMAGES / name / "Dockerfile.dockerignore"


def context_files(name: str) -> list[Path]:
    """Files of the build context that survive the ignore file, as the build sees them.

    The ignore files are allow-lists: ``*``, then ``!path`` entries, then ``**/pattern`` exclusions
    (the only forms used there; anything else is refused so this never silently disagrees with docker).
    """
    allow, exclude = [], []
    for raw in ignore_file(name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or line == "*":
            continue
        if line.startswith("!"):
            allow.append(line[1:].rstrip("/"))
        elif line.startswith("**/"):
            exclude.append(line[3:])
        else:
            raise ValueError(f"{ignore_file(name)}: unsupported pattern {line!r} (use '*', '!path', '**/glob')")
    files: list[Path] = []
    for entry in allow:
        root = REPO / entry
        for path in sorted(root.rglob("*")) if root.is_dir() else [root]:
            rel = path.relative_to(REPO)
            if path.is_file() and not any(fnmatch.fnmatch(part, pat) for part in rel.parts for pat in exclude):
                files.append(rel)
    return files


def base_key() -> str:
    return hashlib.sha256(json.dumps(BASE_RECIPE, sort_keys=True).encode()).hexdigest()[:16]


def image_key(name: str) -> str:
    """Hash of everything that goes into the image: change any of it and the archive is rebuilt."""
    digest = hashlib.sha256()
    for part in (base_key(), json.dumps(build_args(), sort_keys=True), image_refs()[name]):
        digest.update(part.encode() + b"\0")
    for rel in [Path("images") / name / "Dockerfile", ignore_file(name).relative_to(REPO), *context_files(name)]:
        digest.update(str(rel).encode() + b"\0" + (REPO / rel).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def archive_path(name: str) -> Path:
    return cache_dir() / f"kiln-{name}-{image_key(name)}.tar"


# --- tools and the buildah store ------------------------------------------------------------------

def disk_hint(output: str) -> str:
    """For a build that ran out of disk: how much is free and what under the cache holds the most."""
    if "no space left on device" not in output:
        return ""
    from tests.rig import node  # the node imports nothing from here; lazily, since only this message needs it

    root, containerd = build.cache_dir(), node.node_dir() / "containerd"
    free = shutil.disk_usage(root).free / 2**30
    sizes = {}
    for path in (cache_dir(), containerd, root / "rig"):
        if path.exists():
            sizes[path] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    biggest = ", ".join(f"{p} {n / 2**30:.1f} GiB" for p, n in sorted(sizes.items(), key=lambda kv: -kv[1]))
    return (f"\n\nThe disk under {root} is full ({free:.1f} GiB free); the trainer image needs ~7 GiB for its "
            f"archive and twice that in the node. Largest users: {biggest}. `python -m tests.rig down` "
            f"then deleting {containerd} frees the node's images (re-imported on "
            "the next `up --node`).")


def install_tools() -> None:
    """The Debian tools the image build uses (mmdebstrap, buildah, ...), installed when missing."""
    build.install_host_packages(TOOLS, purpose="building kiln's images")


@dataclass(frozen=True)
class Buildah:
    """buildah on a private store under the cache (overlay: layers are diffs, not full copies)."""

    root: Path

    @classmethod
    def default(cls) -> Buildah:
        return cls(cache_dir() / "buildah")

    def env(self) -> dict[str, str]:
        # buildah keeps RUN --mount=type=cache folders under $TMPDIR/buildah-cache-<uid>: in the cache too.
        tmp = self.root / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return {**os.environ, "TMPDIR": str(tmp), "BUILDAH_ISOLATION": "chroot"}

    def cmd(self, *args: str) -> list[str]:
        return ["buildah", "--root", str(self.root / "storage"), "--runroot", str(self.root / "run"),
                "--storage-driver", "overlay", *args]

    def run(self, *args: str, log_to: Path | None = None) -> str:
        """Run one buildah command; a long one streams into log_to, with a progress line every 30 s."""
        if log_to is None:
            proc = subprocess.run(self.cmd(*args), env=self.env(), capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"buildah {' '.join(args)} failed:\n{proc.stderr[-3000:]}{disk_hint(proc.stderr)}")
            return proc.stdout
        start = last = time.monotonic()
        proc = subprocess.Popen(["nice", "-n", "5", *self.cmd(*args)], env=self.env(), text=True,
                                errors="replace", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        tail: list[str] = []

        def copy() -> None:  # each line with its time since the start: how long each layer took
            with open(log_to, "w") as out:
                for line in proc.stdout:
                    out.write(f"{time.monotonic() - start:6.0f}s {line}")
                    out.flush()
                    tail[:] = [line.strip()[:160]]

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        while proc.poll() is None:
            time.sleep(1)
            if time.monotonic() - last >= 30:
                last = time.monotonic()
                log(f"  {time.monotonic() - start:.0f}s: {tail[0] if tail else ''}")
        reader.join()
        if proc.returncode != 0:
            text = log_to.read_text()
            raise RuntimeError(f"buildah {args[0]} failed (log {log_to}):\n{text[-4000:]}{disk_hint(text)}")
        return ""

    def image_labels(self, ref: str) -> dict[str, str] | None:
        proc = subprocess.run(self.cmd("inspect", "--type", "image", ref), env=self.env(),
                              capture_output=True, text=True)
        if proc.returncode != 0:
            return None
        return json.loads(proc.stdout).get("OCIv1", {}).get("config", {}).get("Labels") or {}


# --- the base and the images ---------------------------------------------------------------------

BASE_LABEL = "dev.kiln.rig.base-recipe"


def ensure_base(b: Buildah) -> None:
    """debian:bookworm-slim from Debian's packages, unless the store has it from this recipe."""
    key = base_key()
    if (b.image_labels(BASE_NAME) or {}).get(BASE_LABEL) == key:
        return
    log(f"making {BASE_NAME} with mmdebstrap (recipe {key})")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=b.env()["TMPDIR"]) as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        cmd = ["nice", "-n", "5", "mmdebstrap", "--mode=root", "--format=tar", "--quiet",
               f"--variant={BASE_RECIPE['variant']}"]
        cmd += [f"--dpkgopt={opt}" for opt in BASE_RECIPE["dpkg"]]
        # apt inside later RUN steps reads the same sources; no apt lists are left in the image.
        cmd += ["--customize-hook=rm -rf $1/var/lib/apt/lists/* $1/var/cache/apt/*.bin"]
        cmd += [BASE_RECIPE["suite"], str(rootfs), *BASE_RECIPE["sources"]]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"mmdebstrap failed:\n{proc.stderr[-3000:]}")
        ctr = b.run("from", "scratch").strip()
        try:
            b.run("add", ctr, str(rootfs), "/")
            b.run("config", "--cmd", BASE_RECIPE["config"]["cmd"], "--env", BASE_RECIPE["config"]["env"],
                  "--label", f"{BASE_LABEL}={key}", ctr)
            b.run("commit", "--rm", ctr, BASE_NAME)
        except BaseException:
            subprocess.run(b.cmd("rm", ctr), env=b.env(), capture_output=True)
            raise
    log(f"{BASE_NAME}: {time.monotonic() - start:.0f}s")


# Debian bookworm's python3, the images' interpreter: the wheelhouse holds wheels for it.
IMAGE_PYTHON = "3.11"


def build_home() -> Path:
    """The folder mounted over /root (root's home) in every RUN step of a build; see build_volumes."""
    home = cache_dir() / "build-home"
    (home / ".config/pip").mkdir(parents=True, exist_ok=True)
    (home / "wheelhouse").mkdir(exist_ok=True)
    return home


def build_volumes(wheelhouse_complete: bool) -> list[str]:
    """Build-time settings of this machine for pip inside RUN steps, mounted over /root.

    /root exists in debian:bookworm-slim (only .bashrc and .profile), so unlike a new mount target it
    leaves nothing in any layer; the Dockerfiles' pip cache mount lands inside it. It holds pip's user
    config: the CA bundle pip trusts on this machine (here a TLS-intercepting egress proxy) and the
    wheelhouse, find-links=/root/wheelhouse, from which alone pip installs (no-index) when fill_wheelhouse
    got every wheel.
    """
    home = build_home()
    lines = ["[global]", "find-links = /root/wheelhouse"] + (["no-index = true"] if wheelhouse_complete else [])
    bundle = Path(os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt")
    if bundle.is_file():
        shutil.copyfile(bundle, home / "ca-certificates.crt")
        lines.append("cert = /root/ca-certificates.crt")
    if os.environ.get("PIP_INDEX_URL"):
        lines.append(f"index-url = {os.environ['PIP_INDEX_URL']}")
    (home / ".config/pip/pip.conf").write_text("\n".join(lines) + "\n")
    return ["--volume", f"{home}:/root"]


def fill_wheelhouse() -> bool:
    """Download every wheel the images install into the wheelhouse; True when that worked.

    The Dockerfiles keep pip's cache in a cache mount, but pip caches only responses that allow it and
    the egress proxy here strips PyPI's Cache-Control: without this, every rebuild of the trainer's
    torch layer downloads its GBs again. This pip (on the host, for the images' Python) resolves the
    same requirements as the builds do, and skips the wheels it already has; pip in the build then
    installs from the wheelhouse only (pip 23 prefers the index's copy of a wheel it also finds there).
    """
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    torch = arg_default(IMAGES / "trainer" / "Dockerfile", "TORCH_VERSION")
    reqs = [*project["build-system"]["requires"], *project["project"]["dependencies"],
            *(r for extra in image_extras() for r in extras[extra]), f"torch=={torch}"]
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(build_home() / "wheelhouse"),
           "--only-binary=:all:", "--python-version", IMAGE_PYTHON, *reqs]
    proc = subprocess.run(["nice", "-n", "5", *cmd], capture_output=True, text=True)
    if proc.returncode != 0:  # an optimization only: the build then downloads from the index itself
        log(f"wheelhouse incomplete, the build uses the index (pip download failed): {proc.stderr.strip()[-500:]}")
        return False
    log(f"wheelhouse ready ({time.monotonic() - start:.0f}s)")
    return True


def image_extras() -> list[str]:
    """The extras the trainer image installs kiln with (`kiln-….whl[train,gpu,tracking]` in its Dockerfile).

    Read from the Dockerfile so the wheelhouse cannot miss one: with no-index, a missing package sends pip in
    the build backtracking through every nvidia-* version for hours instead of failing.
    """
    found = re.search(r"kiln-\$\{KILN_VERSION\}-py3-none-any\.whl\[([a-z,]+)\]",
                      (IMAGES / "trainer" / "Dockerfile").read_text())
    if not found:
        raise ValueError("images/trainer/Dockerfile installs no kiln-${KILN_VERSION}-py3-none-any.whl[extras]")
    return found.group(1).split(",")


def arg_default(dockerfile: Path, name: str) -> str:
    """The default of `ARG NAME=value` in a Dockerfile."""
    for line in dockerfile.read_text().splitlines():
        if line.startswith(f"ARG {name}="):
            return line.split("=", 1)[1].strip()
    raise ValueError(f"{dockerfile} has no ARG {name}=...")


def build_image(b: Buildah, name: str, out: Path, wheelhouse_complete: bool) -> Path:
    """Build one image and write its archive to `out` (named by the key taken before the build)."""
    ref = image_refs()[name]
    start = time.monotonic()
    log(f"{name}: building {ref} from images/{name}/Dockerfile (log {out.with_suffix('.log')})")
    cmd = ["bud", "--pull=never", "--layers", "--force-rm", "--isolation", "chroot",
           "-f", str(IMAGES / name / "Dockerfile"), "--ignorefile", str(ignore_file(name)), "-t", ref]
    cmd += [f"--build-arg={k}={v}" for k, v in build_args().items()]
    cmd += build_volumes(wheelhouse_complete)
    b.run(*cmd, str(REPO), log_to=out.with_suffix(".log"))
    built, image = time.monotonic() - start, image_id(ref)
    # An edit that changes no layer (a file outside the context, reverted work) builds the same image: keep
    # its archive instead of writing GBs again.
    same = [r.with_suffix(".tar") for r in cache_dir().glob(f"kiln-{name}-*.json")
            if json.loads(r.read_text()).get("image") == image and r.with_suffix(".tar").is_file()]
    if same:
        same[0].rename(out)
    # One archive per image: they are GBs, so the stale one goes before the new one is written.
    for old in cache_dir().glob(f"kiln-{name}-*"):
        if old.stem != out.stem:
            old.unlink()
    if not same:
        tmp = out.with_suffix(".tar.part")
        tmp.unlink(missing_ok=True)
        b.run("push", ref, f"docker-archive:{tmp}:{ref}")
        tmp.rename(out)
    # Layers of earlier builds that no tagged image uses any more (a kiln change leaves ~0.2 GB each);
    # the torch layer under the new trainer image stays, and with it the cache of the next build.
    b.run("rmi", "--prune")
    record = {"seconds_build": round(built, 1), "seconds_total": round(time.monotonic() - start, 1),
              "bytes": out.stat().st_size, "ref": ref, "image": image, "archive_reused": bool(same)}
    out.with_suffix(".json").write_text(json.dumps(record, indent=2))
    log(f"{name}: {ref} in {record['seconds_total']:.0f}s (bud {built:.0f}s), {record['bytes'] / 2**30:.2f} GiB")
    return out


def ensure_images(names: tuple[str, ...] = ("operator", "trainer")) -> dict[str, Path]:
    """Build what is missing; return each image's docker-archive tar (its name: image_refs()).

    A file lock makes concurrent callers (several pytest sessions) wait for one build.
    """
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        archives = {name: archive_path(name) for name in names}
        todo = [n for n in names if not archives[n].is_file()]
        if todo:
            install_tools()
            b = Buildah.default()
            # A build killed part-way (a stopped session, a CI timeout) leaves its working containers in this
            # private store, and they pin layers that `rmi --prune` then refuses to drop. We hold the lock, so
            # no build of ours is running: any container here is such a leftover.
            b.run("rm", "--all")
            ensure_base(b)
            complete = fill_wheelhouse()
            for name in todo:
                build_image(b, name, archives[name], complete)
                if archive_path(name) != archives[name]:  # the next call builds again
                    log(f"{name}: its sources changed during the build")
        return archives


def archive_config(tar: Path) -> tuple[list[str], str, dict]:
    """(RepoTags, config digest, image config) of a docker-archive, read without unpacking its layers."""
    with tarfile.open(tar) as archive:  # uncompressed: members are found by seeking past the layers
        [entry] = json.load(archive.extractfile("manifest.json"))
        blob = archive.extractfile(entry["Config"]).read()
    return entry["RepoTags"], "sha256:" + hashlib.sha256(blob).hexdigest(), json.loads(blob)


def run_in_image(ref: str, *command: str, user: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a command in a fresh container of a built image (buildah run: the image's ENV, WORKDIR and
    USER unless `user` is given)."""
    b = Buildah.default()
    ctr = b.run("from", "--pull-never", ref).strip()
    try:
        as_user = ["--user", user] if user else []
        return subprocess.run(b.cmd("run", "--isolation", "chroot", *as_user, ctr, "--", *command), env=b.env(),
                              capture_output=True, text=True, timeout=timeout)
    finally:
        subprocess.run(b.cmd("rm", ctr), env=b.env(), capture_output=True)


def image_id(ref: str) -> str:
    return "sha256:" + Buildah.default().run("inspect", "--type", "image", "--format", "{{.FromImageID}}", ref).strip()


def load_into_node(node) -> dict[str, str]:
    """Build what is missing and import each image into the real node's containerd (tests/rig/node.py)
    unless it holds that very image already (same config digest); return {name: image reference}."""
    refs = image_refs()
    for name, tar in ensure_images().items():
        _, digest, _ = archive_config(tar)
        proc = node.crictl("inspecti", "-o", "json", refs[name], check=False)
        held = json.loads(proc.stdout)["status"]["id"] if proc.returncode == 0 and proc.stdout.strip() else None
        if held != digest:
            start = time.monotonic()
            node.import_image(tar)
            log(f"{name}: imported into the node in {time.monotonic() - start:.0f}s")
    if dropped := node.remove_untagged_images():
        log(f"removed {len(dropped)} image(s) of earlier builds from the node")
    return refs


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    for name, path in ensure_images().items():
        print(f"{image_refs()[name]}\t{path}")
    log(f"done in {time.monotonic() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
