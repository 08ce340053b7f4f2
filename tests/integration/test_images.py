"""kiln's images, built from images/*/Dockerfile by tests/rig/images.py, and run.

The archives are what the rig's real node imports (docker-archive tars); the commands run in containers
of the same images from the build's own store (buildah run, the image's USER, ENV and WORKDIR).
The first run on a machine builds both images (the trainer's torch layer is GBs); later runs reuse them.
"""

from __future__ import annotations

import pytest

from kiln.control.config import DEFAULT_IMAGE
from tests.rig import images

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built() -> dict[str, tuple]:
    archives = images.ensure_images()
    return {name: (images.image_refs()[name], archives[name], *images.archive_config(archives[name]))
            for name in archives}


def test_archives_carry_the_names_the_chart_and_the_plan_run(built):
    # Nothing is overridden in the e2e tests: the chart's default operator image and the plan's default
    # trainer image are the names the archives load under.
    assert built["trainer"][0] == DEFAULT_IMAGE
    assert built["operator"][0].startswith("ghcr.io/kiln-dev/kiln-operator:")
    for name, (ref, _, tags, digest, _) in built.items():
        assert tags == [ref], name
        assert images.image_id(ref) == digest, f"{name}: the archive is not the image the store holds"


def test_operator_image_runs_kiln_operator_as_non_root(built):
    ref, _, _, _, config = built["operator"]
    assert config["config"]["User"] == "65532:65532"
    assert config["config"]["Entrypoint"] == ["kiln", "operator"]
    code = ("import sys, kiln.control.serve, kiln.control.metrics\n"
            "assert 'torch' not in sys.modules\n"
            "import os, getpass; print(os.getuid(), os.access('/opt/kiln', os.W_OK), getpass.getuser())\n")
    proc = images.run_in_image(ref, "python", "-c", code)
    assert proc.returncode == 0, proc.stderr
    # non-root: cannot change its own program; and a named user (kopf asks getpass who it runs as: without a
    # passwd entry the operator died at start in its pod, "getpwuid(): uid not found: 65532")
    assert proc.stdout.split() == ["65532", "False", "kiln"]
    proc = images.run_in_image(ref, "kiln", "operator", "--help")
    assert proc.returncode == 0 and "--health-port" in proc.stdout, proc.stderr


@pytest.mark.parametrize("name", ["operator", "trainer"])
def test_build_time_settings_leave_no_trace(built, name):
    # The build mounts this machine's pip settings (CA bundle, wheelhouse) over /root; none of it may be in
    # an image: root's home is what debian:bookworm-slim has, and no pip.conf exists anywhere pip looks.
    proc = images.run_in_image(built[name][0], "sh", "-c",
                               "ls -A /root; ls /etc/pip.conf /etc/xdg/pip /opt/kiln/pip.conf 2>/dev/null; true",
                               user="0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [".bashrc", ".profile"]


def test_trainer_image_runs_torch_and_compiles_on_cpu(built):
    ref, _, _, _, config = built["trainer"]
    assert config["config"]["User"] == "10001:10001"
    assert config["config"]["Entrypoint"] == ["torchrun"]
    torch_pin = images.arg_default(images.IMAGES / "trainer" / "Dockerfile", "TORCH_VERSION")
    # torch.compile is on by default (spec.model.compile): Inductor compiles C++ on CPU, so the image needs
    # its compiler and Python's headers; the compile cache goes where the image's ENV says (/tmp).
    code = (
        "import os, torch, kiln.trainer.loop, kiln.trainer.model.kernels\n"
        "f = torch.compile(lambda x: torch.nn.functional.silu(x) * 2)\n"
        "x = torch.randn(64)\n"
        "assert torch.allclose(f(x), torch.nn.functional.silu(x) * 2)\n"
        "print(torch.__version__.split('+')[0], os.getuid(), sorted(os.listdir(os.environ['TORCHINDUCTOR_CACHE_DIR']))!=[])\n"
    )
    proc = images.run_in_image(ref, "python", "-c", code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [torch_pin, "10001", "True"]
    proc = images.run_in_image(ref, "torchrun", "--help")
    assert proc.returncode == 0 and "--nproc-per-node" in proc.stdout, proc.stderr[-2000:]
