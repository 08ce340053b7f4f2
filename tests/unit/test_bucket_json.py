"""Files read whole from a bucket are bounded (issue 28): each kind has a size cap checked before any byte is
downloaded, and JSON the parser refuses — nested 200,000 deep, not UTF-8, an integer past Python's digit limit —
is one KilnError naming the file, through every reader a user reaches (model.from, data.tokenizer, a chat
template, a checkpoint's COMMIT and trainer.json)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.storage import FileStore
from kiln.storage.bounded import LIMITS, read_bytes, read_json
from kiln.storage.commit import read_commit, read_trainer_state, step_dir
from kiln.trainer.model import hf_folder as hf
from kiln.trainer.data.chat import load_chat_template

DEEP = b"[" * 200_000  # json.loads raises RecursionError on this
BAD = {"nested": DEEP, "not utf-8": b"\xff\xfe{", "huge int": b'{"a": ' + b"9" * 5000 + b"}"}


class CountingStore(FileStore):
    """A FileStore that counts the bytes handed out by get_bytes."""

    downloaded = 0

    def get_bytes(self, key, offset=0, length=None):
        data = super().get_bytes(key, offset, length)
        self.downloaded += len(data)
        return data


def oversize(path: Path, kind: str) -> None:
    """A sparse file one byte past the kind's cap (no disk used)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(LIMITS[kind] + 1)


@pytest.mark.parametrize("kind", sorted(LIMITS))
def test_a_file_over_its_cap_is_refused_naming_it_before_a_byte_is_read(tmp_path, kind):
    oversize(tmp_path / "x" / kind, kind)
    store = CountingStore(tmp_path)
    with pytest.raises(KilnError) as err:
        read_bytes(store, f"x/{kind}", what="model.from s3://b/m")
    assert str(err.value).startswith(f"model.from s3://b/m: file://{tmp_path}/x/{kind} has {LIMITS[kind] + 1} bytes")
    assert f"at most {LIMITS[kind]}" in str(err.value)
    assert store.downloaded == 0


@pytest.mark.parametrize("bad", sorted(BAD))
def test_json_the_parser_refuses_is_one_error_naming_the_file(tmp_path, bad):
    (tmp_path / "config.json").write_bytes(BAD[bad])
    with pytest.raises(KilnError, match=rf"^file://{tmp_path}/config.json is not valid JSON \("):
        read_json(FileStore(tmp_path), "config.json")


def test_model_folder_files_are_bounded(tmp_path):
    oversize(tmp_path / "big" / "config.json", "config.json")
    with pytest.raises(KilnError, match=rf"model.from file://{tmp_path}/big/: .*big/config.json has \d+ bytes"):
        hf.read_config(f"file://{tmp_path}/big/")
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "config.json").write_bytes(DEEP)
    with pytest.raises(KilnError, match=r"deep/config.json is not valid JSON \(nested too deeply\)"):
        hf.read_config(f"file://{tmp_path}/deep/")


def test_tokenizer_files_are_bounded(tmp_path):
    oversize(tmp_path / "tok" / "tokenizer.json", "tokenizer.json")
    with pytest.raises(KilnError, match=r"data.tokenizer .*tok/tokenizer.json has \d+ bytes; a tokenizer.json file"):
        hf.load_tokenizer(f"file://{tmp_path}/tok/")
    (tmp_path / "chat").mkdir()
    (tmp_path / "chat" / "tokenizer_config.json").write_bytes(DEEP)
    with pytest.raises(KilnError, match=r"data.tokenizer .*chat/tokenizer_config.json is not valid JSON \(nested"):
        load_chat_template(f"file://{tmp_path}/chat/")
    (tmp_path / "chat" / "tokenizer_config.json").write_text("{}")
    oversize(tmp_path / "chat" / "chat_template.jinja", "chat_template.jinja")
    with pytest.raises(KilnError, match=r"chat/chat_template.jinja has \d+ bytes; a chat_template.jinja file"):
        load_chat_template(f"file://{tmp_path}/chat/")


@pytest.mark.parametrize("bad", sorted(BAD))
def test_commit_and_trainer_state_that_do_not_parse_are_kiln_errors(tmp_path, bad):
    folder = tmp_path / step_dir(3)
    folder.mkdir()
    (folder / "COMMIT").write_bytes(BAD[bad])
    (folder / "trainer.json").write_bytes(BAD[bad])
    store = FileStore(tmp_path)
    with pytest.raises(KilnError, match=rf"step-00000003/COMMIT is not valid JSON"):
        read_commit(store, 3)
    with pytest.raises(KilnError, match=rf"step-00000003/trainer.json is not valid JSON"):
        read_trainer_state(store, 3)
