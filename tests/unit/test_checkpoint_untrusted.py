"""Checkpoint bytes never run code (issue 13, item 1).

Someone who can write the bucket can also rewrite COMMIT, so a matching sha256 proves nothing about who
wrote a file. Each test forges a committed checkpoint whose `.metadata`, non-tensor item or tensor item
would run `touch MARKER` when unpickled, with a COMMIT that matches it, and requires every way kiln loads
checkpoints (a resuming trainer, `kiln eval`, `kiln export`) to refuse it with a KilnError naming the file,
without the marker ever appearing.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from kiln.api.spec import CheckpointSpec
from kiln.cli.main import main
from kiln.errors import KilnError
from kiln.trainer.checkpoint.checkpointer import Checkpointer
from kiln.trainer.checkpoint.dcp_store import load_metadata
from tests.forged_checkpoints import RunsCommand, forge, metadata_with, redirect_item, torch_blob


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def checkpointer(root: Path) -> Checkpointer:
    return Checkpointer(CheckpointSpec(uri=f"file://{root}"), default_uri="", rank=0, world_size=1)


def save(root: Path, model, optimizers, step: int = 2) -> None:
    ck = checkpointer(root)
    ck.save(step, [model], optimizers, {"step": step}, final=True)
    ck.close()


def assert_restore_refused(root: Path, marker: Path, *fragments: str) -> None:
    """Restoring a fresh model from `root` fails with a KilnError naming every fragment, and ran nothing."""
    fresh, fresh_opt = make()
    with pytest.raises(KilnError) as err:
        checkpointer(root).restore([fresh], [fresh_opt])
    text = str(err.value)
    assert all(f in text for f in fragments), text
    assert "Traceback" not in text
    assert not marker.exists(), "the checkpoint ran code"


@pytest.mark.parametrize("payload", ["in the metadata", "as the whole metadata"])
def test_metadata_that_would_run_code_is_refused(tmp_path, payload):
    marker = tmp_path / "ran"
    root = tmp_path / "ckpt"
    model, opt = make()
    save(root, model, [opt])
    evil = (metadata_with(root, 2, RunsCommand(marker)) if payload == "in the metadata"
            else pickle.dumps(RunsCommand(marker)))
    forge(root, 2, {".metadata": evil})

    assert_restore_refused(root, marker, f"file://{root}/step-00000002/.metadata", "posix.system", "refused")


def test_a_non_tensor_item_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    root = tmp_path / "ckpt"
    model, opt = make()
    save(root, model, [opt])
    fqn = "optim.param_groups.0.weight.lr"  # a float, stored by DCP as a pickled (BYTE_IO) item
    redirect_item(root, 2, fqn, torch_blob(RunsCommand(marker)))

    assert_restore_refused(root, marker, f"file://{root}/step-00000002/__0_0.distcp", fqn, "run code")


def test_a_tensor_item_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    root = tmp_path / "ckpt"
    model, opt = make()
    save(root, model, [opt])
    redirect_item(root, 2, "model.0.weight", torch_blob(RunsCommand(marker)))

    assert_restore_refused(root, marker, f"file://{root}/step-00000002/__0_0.distcp", "run code")


def test_an_intact_checkpoint_still_restores_every_item(tmp_path):
    """The restricted reads load what kiln writes: weights, optimizer moments and the param_groups' values."""
    root = tmp_path / "ckpt"
    model, opt = make()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.param_groups[0]["lr"] = 0.0123  # a non-tensor item with a value of its own
    save(root, model, [opt])

    fresh, fresh_opt = make()
    fresh[0].weight.data.zero_()
    assert checkpointer(root).restore([fresh], [fresh_opt])["step"] == 2
    assert torch.equal(fresh[0].weight, model[0].weight)
    assert fresh_opt.param_groups[0]["lr"] == 0.0123 and fresh_opt.param_groups[0]["betas"] == (0.9, 0.999)
    assert torch.equal(fresh_opt.state[fresh_opt.param_groups[0]["params"][0]]["exp_avg"],
                       opt.state[opt.param_groups[0]["params"][0]]["exp_avg"])


def tiny_spec(path: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "untrusted"},
        "spec": {"model": {"preset": "tiny"}, "training": {"globalBatchSize": 2, "microBatchSize": 1},
                 "parallelism": {"compile": False, "kernels": "reference"}},
    }))
    return path


@pytest.mark.parametrize("command", ["eval", "export"])
def test_kiln_eval_and_export_refuse_a_checkpoint_that_would_run_code(tmp_path, capsys, command):
    """On a workstation too: the checkpoint of a run is loaded into this process, never its code."""
    from kiln.api.load import load_file
    from kiln.trainer.evaluate import initial_model, model_dims

    marker = tmp_path / "ran"
    root = tmp_path / "ckpt"
    spec = tiny_spec(tmp_path / "spec.yaml")
    (doc,) = load_file(spec)
    save(root, initial_model(doc, model_dims(doc), torch.device("cpu")), [])
    forge(root, 2, {".metadata": metadata_with(root, 2, RunsCommand(marker))})

    args = ["eval", str(spec), "--checkpoint", f"file://{root}", "--device", "cpu", "--batches", "1"] \
        if command == "eval" else ["export", str(spec), "--checkpoint", f"file://{root}",
                                   "--output", f"file://{tmp_path / 'hf'}"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"file://{root}/step-00000002/.metadata" in err and "refused" in err and "Traceback" not in err
    assert not marker.exists(), "the checkpoint ran code"
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())


class _EnumsByName(pickle.Pickler):
    """Pickles enum members as getattr(EnumClass, "NAME"), as Debian's Python 3.11.2 (kiln's trainer image)
    does: the metadata the real trainer wrote in its pod."""

    def reducer_override(self, obj):
        import enum

        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def test_metadata_with_enum_members_pickled_by_name_loads(tmp_path):
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                        TensorStorageMetadata)

    props = TensorProperties(dtype=torch.float32)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2]))
    metadata = Metadata(state_dict_metadata={"w": TensorStorageMetadata(props, torch.Size([2]), [chunk])})
    buf = io.BytesIO()
    _EnumsByName(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(metadata)
    assert b"getattr" in buf.getvalue()
    loaded = load_metadata(io.BytesIO(buf.getvalue()), "s3://b/step-00000001/.metadata")
    assert loaded.state_dict_metadata["w"].properties == props


@pytest.mark.parametrize("owner, name", [("Metadata", "__init__"), ("_MEM_FORMAT_ENCODING", "__class__"),
                                         ("_MEM_FORMAT_ENCODING", "_missing_")])
def test_getattr_reaches_nothing_but_an_allowed_enum_member(owner, name):
    """getattr is resolved only as `AllowedEnum.MEMBER`: not a method, not a dunder, not another class's."""
    import torch.distributed.checkpoint.metadata as dcp_metadata

    target = getattr(dcp_metadata, owner)

    class Forged:
        def __reduce__(self):
            return getattr, (target, name)

    with pytest.raises(KilnError, match=r"getattr\(.*refused"):
        load_metadata(io.BytesIO(pickle.dumps(Forged())), "s3://b/step-00000001/.metadata")
