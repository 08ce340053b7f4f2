"""Build the rig's binaries from Go modules into a cache keyed by versions.

Each component gets a small wrapper module (``go.mod`` with ``require``,
``tool`` and, for Kubernetes, ``replace`` lines) generated under the cache;
``go mod tidy`` resolves it through the module proxy and one ``go build`` per
component compiles all its main packages, so they share work.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.rig import versions

REPO = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR") or REPO / ".cache")


def go_version() -> str:
    if shutil.which("go") is None:
        raise RuntimeError("the rig is built from Go modules: put Go >= 1.26 on PATH (apt: golang-go is too old)")
    return subprocess.run(["go", "env", "GOVERSION"], check=True, capture_output=True, text=True).stdout.strip()


# Groups of components, each in its own cache folder: the control plane (what every rig
# test needs), Kueue (started on demand by the tests that use it) and the real node (built
# only when a node is asked for).
CONTROL_PLANE, KUEUE, NODE = "control-plane", "kueue", "node"


def group_of(name: str) -> str:
    if name in versions.NODE_BUILD_ORDER:
        return NODE
    return KUEUE if name in versions.KUEUE_BUILD_ORDER else CONTROL_PLANE


def group_members(group: str) -> list[str]:
    return {NODE: versions.NODE_BUILD_ORDER, KUEUE: versions.KUEUE_BUILD_ORDER}.get(group, versions.BUILD_ORDER)


def cache_key(group: str = CONTROL_PLANE) -> str:
    pins = {name: versions.COMPONENTS[name]["require"] for name in group_members(group)}
    blob = json.dumps({"go": go_version(), "pins": pins}, sort_keys=True).encode()
    if group == KUEUE:
        return f"kueue-{versions.KUEUE}-{hashlib.sha256(blob).hexdigest()[:10]}"
    prefix = "node-k8s" if group == NODE else "k8s"
    return f"{prefix}-{versions.KUBERNETES}-{hashlib.sha256(blob).hexdigest()[:10]}"


def rig_dir(group: str = CONTROL_PLANE) -> Path:
    return cache_dir() / "rig" / cache_key(group)


def bin_dir(group: str = CONTROL_PLANE) -> Path:
    return rig_dir(group) / "bin"


def node_bin_dir() -> Path:
    return bin_dir(NODE)


def binary_names(name: str) -> list[str]:
    spec = versions.COMPONENTS[name]
    names = spec.get("binaries", {})
    return [names.get(pkg, pkg.rsplit("/", 1)[-1]) for pkg in spec["packages"]]


def _files_digest(name: str) -> str:
    """Hash of the repository files a component builds (its own Go sources), if any."""
    files = versions.COMPONENTS[name].get("files", {})
    digest = hashlib.sha256()
    for dest, src in sorted(files.items()):
        digest.update(dest.encode() + b"\0" + (REPO / src).read_bytes() + b"\0")
    return digest.hexdigest()[:16] if files else ""


def is_built(name: str) -> bool:
    group = group_of(name)
    stamp = rig_dir(group) / "stamps" / name
    if not (all((bin_dir(group) / b).is_file() for b in binary_names(name)) and stamp.is_file()):
        return False
    # Components built from our own sources rebuild when those change (pins are in the key).
    return not _files_digest(name) or json.loads(stamp.read_text()).get("files") == _files_digest(name)


def log(msg: str) -> None:
    print(f"[rig build {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def go_env() -> dict[str, str]:
    env = dict(os.environ)
    # Two cores: one compile at a time per build, two builds' worth of packages in flight.
    flags = env.get("GOFLAGS", "").split()
    flags = [f for f in flags if not f.startswith("-p=")] + ["-p=2", "-buildvcs=false"]
    env["GOFLAGS"] = " ".join(dict.fromkeys(flags))
    env["CGO_ENABLED"] = "0"
    env.setdefault("GOTOOLCHAIN", "local")
    # Go's build and module caches reach ~18 GB for Kubernetes; only a build needs them (the binaries are
    # cached by version), so they live under the rig's cache and a finished build drops them (drop_go_caches).
    env["GOCACHE"] = str(cache_dir() / "go" / "build")
    env["GOMODCACHE"] = str(cache_dir() / "go" / "mod")
    return env


def drop_go_caches() -> None:
    """Remove the Go caches a build filled: CI's disk is shared, and a warm run never compiles."""
    subprocess.run(["go", "clean", "-modcache"], env=go_env(), capture_output=True)  # its files are read-only
    shutil.rmtree(cache_dir() / "go", ignore_errors=True)


def _staging_replaces(kube_version: str) -> list[str]:
    """`replace` lines pointing every staging module of k8s.io/kubernetes at its published v0.x."""
    out = subprocess.run(
        ["go", "mod", "download", "-json", f"k8s.io/kubernetes@{kube_version}"],
        check=True, capture_output=True, text=True, env=go_env(),
    )
    gomod = Path(json.loads(out.stdout)["GoMod"]).read_text()
    staging = sorted(set(re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", gomod, re.MULTILINE)))
    if not staging:
        raise RuntimeError(f"no staging replace lines found in k8s.io/kubernetes@{kube_version} go.mod")
    v0 = "v0." + kube_version.removeprefix("v1.")
    return [f"replace {mod} => {mod} {v0}" for mod in staging]


def write_wrapper(name: str) -> Path:
    spec = versions.COMPONENTS[name]
    src = rig_dir(group_of(name)) / "src" / name
    src.mkdir(parents=True, exist_ok=True)
    minor = go_version().removeprefix("go").split(".")[:2]
    lines = [f"module kiln.local/rig/{name}", "", f"go {'.'.join(minor)}", ""]
    lines += [f"require {mod} {ver}" for mod, ver in spec["require"].items()]
    # `tool` lines for other modules' main packages; "./x" are our own, copied in below.
    lines += [f"tool {pkg}" for pkg in spec["packages"] if not pkg.startswith(".")]
    if spec.get("staging"):
        lines += _staging_replaces(spec["require"]["k8s.io/kubernetes"])
    for dest, repo_path in spec.get("files", {}).items():
        (src / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / repo_path, src / dest)
    text = "\n".join(lines) + "\n"
    tidy_key = text + _files_digest(name)  # our sources' imports change what tidy resolves
    gomod = src / "go.mod"
    if not gomod.exists() or not (src / ".tidy").exists() or (src / ".tidy").read_text() != tidy_key:
        gomod.write_text(text)
        subprocess.run(["go", "mod", "tidy"], cwd=src, check=True, env=go_env())
        (src / ".tidy").write_text(tidy_key)
    return src


def ldflags(name: str, src: Path) -> str:
    spec = versions.COMPONENTS[name]
    flags = ["-s", "-w"] + [f"-X {var}={value}" for var, value in spec.get("version_vars", {}).items()]
    if "k8s.io/kubernetes" in spec["require"]:  # kubelet too: else it reports v0.0.0-master
        v = versions.KUBERNETES
        major, minor = v.removeprefix("v").split(".")[:2]
        values = {
            "gitVersion": v, "gitMajor": major, "gitMinor": minor,
            "gitTreeState": "clean", "gitCommit": "0000000000000000000000000000000000000000",
            "buildDate": "1970-01-01T00:00:00Z",
        }
        for pkg in ("k8s.io/client-go/pkg/version", "k8s.io/component-base/version"):
            flags += [f"-X {pkg}.{k}={val}" for k, val in values.items()]
    if name == "helm":
        # As helm's own Makefile: its version, and the default kubeVersion from its client-go.
        flags += [f"-X helm.sh/helm/v3/internal/version.version={versions.HELM}",
                  "-X helm.sh/helm/v3/internal/version.gitTreeState=clean"]
        client_go = subprocess.run(
            ["go", "list", "-m", "-f", "{{.Version}}", "k8s.io/client-go"],
            cwd=src, check=True, capture_output=True, text=True, env=go_env(),
        ).stdout.strip()
        minor = client_go.removeprefix("v0.").split(".")[0]
        for pkg in ("helm.sh/helm/v3/pkg/lint/rules", "helm.sh/helm/v3/pkg/chartutil"):
            flags += [f"-X {pkg}.k8sVersionMajor=1", f"-X {pkg}.k8sVersionMinor={minor}"]
    return " ".join(flags)


def _go_build(name: str, src: Path) -> None:
    spec = versions.COMPONENTS[name]
    out = bin_dir(group_of(name))
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["nice", "-n", "10", "go", "build", "-v", "-trimpath", "-ldflags", ldflags(name, src)]
    if spec.get("tags"):
        cmd += ["-tags", ",".join(spec["tags"])]
    if len(spec["packages"]) == 1:
        cmd += ["-o", str(out / binary_names(name)[0])]
    else:
        cmd += ["-o", str(out) + "/"]
    cmd += spec["packages"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=src, env=go_env(), stderr=subprocess.PIPE, text=True)
    count, last, tail = 0, start, []
    assert proc.stderr is not None
    for line in proc.stderr:
        count += 1
        tail = (tail + [line.rstrip()])[-40:]
        now = time.monotonic()
        if now - last >= 30:
            log(f"{name}: {count} packages compiled, {now - start:.0f}s, last {line.strip()}")
            last = now
    if proc.wait() != 0:
        raise RuntimeError(f"go build of {name} failed:\n" + "\n".join(tail))


def build(names: list[str] | None = None) -> dict[str, float]:
    """Build what is missing (default: the control plane); return seconds spent per
    component (0 for cached ones).

    A file lock makes concurrent callers (several pytest sessions) wait for one build.
    """
    names = names or versions.BUILD_ORDER
    times: dict[str, float] = {}
    for group in dict.fromkeys(group_of(n) for n in names):
        rig_dir(group).mkdir(parents=True, exist_ok=True)
        with open(rig_dir(group) / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            times |= _build(group, [n for n in names if group_of(n) == group])
    return times


def build_node() -> dict[str, float]:
    """Everything the real node needs: its Debian packages and its Go components."""
    install_host_packages()
    return build(versions.NODE_BUILD_ORDER)


def ensure_sbin_on_path() -> None:
    """Put /usr/sbin and /sbin on PATH (for this process and what it starts): iptables, conntrack and runc
    live there, and a non-login shell's or a CI runner's PATH may lack them even for root."""
    parts = os.environ.get("PATH", "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join(parts + [d for d in ("/usr/sbin", "/sbin") if d not in parts])


def install_host_packages(packages: dict[str, str] | None = None, purpose: str = "the real node") -> None:
    """apt-get install the Debian packages whose program is missing; `packages` maps program → package
    (default: the node's runc, iptables, ...). CI starts on a fresh machine, so the rig installs them itself."""
    ensure_sbin_on_path()
    packages = versions.NODE_HOST_PACKAGES if packages is None else packages
    missing = sorted({pkg for exe, pkg in packages.items() if shutil.which(exe) is None})
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise RuntimeError(f"{purpose} needs the Debian packages {missing}; install them (no apt-get here)")
    log(f"installing Debian packages {', '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    # A fresh machine may have no package lists yet: update once and try again.
    if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, check=True, capture_output=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            output = proc.stdout[-2000:] + proc.stderr[-2000:]
            raise RuntimeError(f"apt-get install {' '.join(missing)} failed:\n{output}")


def _build(group: str, names: list[str]) -> dict[str, float]:
    todo = [n for n in names if not is_built(n)]
    times: dict[str, float] = {n: 0.0 for n in names if n not in todo}
    if not todo:
        log(f"all {len(names)} components cached in {rig_dir(group)}")
        return times
    log(f"building {', '.join(todo)} into {rig_dir(group)} (cached: {', '.join(times) or 'none'})")
    total = time.monotonic()
    # Resolving modules is network-bound: prepare every wrapper while the first builds compile.
    srcs: dict[str, Path] = {}
    errors: dict[str, BaseException] = {}
    ready = {n: threading.Event() for n in todo}

    def prepare(n: str) -> None:
        try:
            srcs[n] = write_wrapper(n)
        except BaseException as exc:  # reported by the builder loop below
            errors[n] = exc
        finally:
            ready[n].set()

    threads = [threading.Thread(target=prepare, args=(n,), daemon=True) for n in todo]
    for t in threads:
        t.start()
    for n in todo:
        ready[n].wait()
        if n in errors:
            raise RuntimeError(f"resolving modules for {n} failed: {errors[n]}") from errors[n]
        log(f"{n}: compiling {', '.join(binary_names(n))}")
        start = time.monotonic()
        _go_build(n, srcs[n])
        times[n] = time.monotonic() - start
        stamps = rig_dir(group) / "stamps"
        stamps.mkdir(parents=True, exist_ok=True)
        stamp = {"seconds": round(times[n], 1), "require": versions.COMPONENTS[n]["require"]}
        if _files_digest(n):
            stamp["files"] = _files_digest(n)
        (stamps / n).write_text(json.dumps(stamp))
        log(f"{n}: done in {times[n]:.0f}s")
    log(f"built {len(todo)} components in {time.monotonic() - total:.0f}s")
    drop_go_caches()
    record = rig_dir(group) / "build-times.json"
    record.write_text(json.dumps({"total_seconds": round(time.monotonic() - total, 1), "components": times}, indent=2))
    return times


def module_dir(module: str, version: str) -> Path:
    """Directory of a module in the Go module cache (downloading it if needed)."""
    out = subprocess.run(
        ["go", "mod", "download", "-json", f"{module}@{version}"],
        check=True, capture_output=True, text=True, env=go_env(),
    )
    return Path(json.loads(out.stdout)["Dir"])


def clean() -> None:
    shutil.rmtree(rig_dir(), ignore_errors=True)
    shutil.rmtree(rig_dir(NODE), ignore_errors=True)
