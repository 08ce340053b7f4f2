"""`kiln data prepare --gopher --c4 --languages`: DataTrove's Gopher, C4 and language filters drop the planted
documents, each counted under the filter's own reason, the same in one process and in the cluster stages. The
fastText language-ID model cannot be downloaded here: the test trains a tiny one with fastText itself (en vs de)
and hands it over as a file:// URI, which is the plumbing a user's lid.176.bin goes through."""

from __future__ import annotations

import json

import pytest

from kiln.cli.main import main
from kiln.errors import KilnError
from kiln.trainer.data import prepare as one
from kiln.trainer.data import stages
from tests.support.data_stages import outputs, run_here, tokenizer_file  # noqa: F401

ENGLISH = [
    "The cat sat on the mat, and it was a very good day for all of the people who live in the town.",
    "She said that the weather would be fine for the rest of the week and that they should go out.",
    "Then they walked to the park with their dogs and had a long talk about the books they read.",
    "After that, the children played in the garden until it was time to have dinner with the family.",
    "It was the kind of evening that everyone would remember for a long time, and they were all happy.",
    "In the end they went home and slept well, because the day had been long and the air was fresh.",
]
GERMAN = [
    "Die Katze sass auf der Matte, und es war ein sehr guter Tag fuer alle Leute, die in der Stadt wohnen.",
    "Sie sagte, dass das Wetter fuer den Rest der Woche schoen sein wuerde und dass sie hinausgehen sollten.",
    "Dann gingen sie mit ihren Hunden in den Park und sprachen lange ueber die Buecher, die sie gelesen hatten.",
    "Danach spielten die Kinder im Garten, bis es Zeit war, mit der Familie zu Abend zu essen.",
    "Es war die Art von Abend, an die sich alle noch lange erinnern wuerden, und sie waren alle gluecklich.",
    "Am Ende gingen sie nach Hause und schliefen gut, denn der Tag war lang gewesen und die Luft war frisch.",
]


@pytest.fixture(scope="module")
def language_model(tmp_path_factory):
    """A fastText language-ID model trained here on the sentences above (labels as lid.176.bin's: __label__xx)."""
    import fasttext

    folder = tmp_path_factory.mktemp("lid")
    lines = [f"__label__en {s}" for s in ENGLISH] + [f"__label__de {s}" for s in GERMAN]
    (folder / "train.txt").write_text("\n".join(lines * 20) + "\n")
    model = fasttext.train_supervised(str(folder / "train.txt"), epoch=25, minn=2, maxn=4, dim=16, thread=1,
                                      seed=0, verbose=0)
    model.save_model(str(folder / "lid.bin"))
    return f"file://{folder / 'lid.bin'}"


def corpus(folder):
    folder.mkdir()
    docs = {
        "good": "\n".join(ENGLISH),
        "good2": "\n".join(reversed(ENGLISH)),
        "short": ENGLISH[0],                                                  # gopher_short_doc: 21 words
        "lorem": "\n".join(ENGLISH) + "\nLorem ipsum dolor sit amet, consectetur.",  # c4_lorem_ipsum
        "german": "\n".join(GERMAN),                                          # language
    }
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs.values()))
    return folder


WANT = {"c4_lorem_ipsum": 1, "gopher_short_doc": 1, "language": 1}


def test_quality_filters_drop_what_datatrove_drops_here_and_in_the_stages(tmp_path, tokenizer_file,  # noqa: F811
                                                                          language_model, capsys):
    src = corpus(tmp_path / "src")
    flags = ["--gopher", "--c4", "--languages", "en", "--language-model", language_model]
    assert main(["data", "prepare", "--input", str(src), "--tokenizer", f"file://{tokenizer_file}",
                 "--output", f"file://{tmp_path / 'one'}", *flags]) == 0
    manifest = json.loads((tmp_path / "one" / "manifest.json").read_text())
    assert manifest["removed"] == WANT and manifest["documents_out"] == 2
    assert manifest["quality"]["languages"] == ["en"]

    quality = {"gopher": True, "c4": True, "languages": ["en"], "language_model": language_model,
               "language_threshold": 0.65}
    out = f"file://{tmp_path / 'two'}"
    stages.plan([str(src)], out, tokenizer_uri=f"file://{tokenizer_file}", workers=2, partitions=2, quality=quality)
    run_here(out)
    mine, theirs = outputs(tmp_path / "two"), outputs(tmp_path / "one")
    mine_manifest, their_manifest = json.loads(mine.pop("manifest.json")), json.loads(theirs.pop("manifest.json"))
    assert mine == theirs
    mine_manifest.pop("partitions")
    assert mine_manifest == their_manifest


def test_a_language_filter_without_a_readable_model_is_one_line(tmp_path, tokenizer_file, capsys):  # noqa: F811
    src = corpus(tmp_path / "src")
    (tmp_path / "junk.bin").write_bytes(b"not a model")
    for extra, want in [([], "--languages needs --language-model"),
                        (["--language-model", f"file://{tmp_path / 'junk.bin'}"], "--language-model file://"),
                        (["--language-model", f"file://{tmp_path / 'none.bin'}"], "--language-model file://")]:
        rc = main(["data", "prepare", "--input", str(src), "--tokenizer", f"file://{tokenizer_file}",
                   "--output", f"file://{tmp_path / 'out'}", "--languages", "en", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 1 and len(err) == 1 and want in err[0], err
    with pytest.raises(KilnError, match="not with --format chat"):
        one.prepare([str(src)], tokenizer_uri=f"file://{tokenizer_file}", output=f"file://{tmp_path / 'c'}",
                    format="chat", quality={"gopher": True})
