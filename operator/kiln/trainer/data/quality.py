"""Quality filters of `kiln data prepare` (--gopher, --c4, --languages): DataTrove's GopherQualityFilter,
C4QualityFilter and LanguageFilter, run on each normalised document; a document one of them drops is counted under
the filter's own reason (gopher_short_doc, c4_too_few_sentences, language, ...). C4's filter also removes lines
(no terminal punctuation, "javascript", ...): what it keeps is what is tokenized.

Two things are kiln's own, because DataTrove's defaults download at run time, which kiln's pods must not:
- the word and sentence splitter: DataTrove's English one is spaCy's (or NLTK's punkt model, downloaded); kiln
  gives its filters NLTK's NLTKWordTokenizer over an untrained Punkt sentence splitter, neither of which needs data;
- the fastText language-ID model: DataTrove's LanguageFilter downloads lid.176.bin; here it is a URI the user
  gives (--language-model s3://... or file://), fetched once per worker with kiln.storage."""

from __future__ import annotations

import tempfile
from collections.abc import Callable

from kiln.errors import KilnError

Filter = Callable[[str], "tuple[str | None, str]"]  # text → (the text to keep or None, why it was dropped)


def _splitter():
    from datatrove.utils.word_tokenizers import WordTokenizer
    from nltk.tokenize import NLTKWordTokenizer
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    class Splitter(WordTokenizer):
        """NLTK's word tokenizer per sentence of an untrained Punkt splitter: no model to download."""

        def __init__(self):
            super().__init__("en")
            self.sentences, self.words = PunktSentenceTokenizer(), NLTKWordTokenizer()

        def word_tokenize(self, text: str) -> list[str]:
            return [w.strip() for s in self.sentences.tokenize(text) for w in self.words.tokenize(s) if w.strip()]

        def sent_tokenize(self, text: str) -> list[str]:
            return [s.strip() for s in self.sentences.tokenize(text) if s.strip()]

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return list(self.sentences.span_tokenize(text))

    return Splitter()


def _language_model(uri: str, endpoint: str | None):
    """fastText's model from the user's URI (a local copy: fastText reads a path)."""
    import fasttext

    from kiln.storage import open_store
    from kiln.storage.store import ObjectNotFound

    folder, key = uri.rsplit("/", 1)
    local = tempfile.NamedTemporaryFile(prefix="kiln-lid-", suffix=".bin")
    try:
        open_store(folder + "/", endpoint=endpoint).get_file(key, local.name)
        model = fasttext.load_model(local.name)
    except (ObjectNotFound, ValueError) as err:
        raise KilnError(f"--language-model {uri}: not a fastText model kiln can read ({err})") from None
    finally:
        local.close()
    return model


def make_filters(settings: dict, endpoint: str | None = None) -> list[Filter]:
    """The filters `settings` ask for ({"gopher": bool, "c4": bool, "languages": [...], "language_model": uri,
    "language_threshold": float}), in that order: language first, as in DataTrove's FineWeb pipeline."""
    if not any(settings.get(k) for k in ("gopher", "c4", "languages")):
        return []
    from datatrove.data import Document

    filters: list[Filter] = []

    def wrap(block, prefix: str = "") -> Filter:
        def run(text: str):
            doc = Document(text=text, id="")
            verdict = block.filter(doc)
            keep, why = verdict if isinstance(verdict, tuple) else (verdict, "")
            return (doc.text if keep else None), prefix + (why or "")
        return run

    if settings.get("languages"):
        if not settings.get("language_model"):
            raise KilnError("--languages needs --language-model: a fastText language-ID model's URI (lid.176.bin)")
        from datatrove.pipeline.filters import LanguageFilter
        from datatrove.utils.lid import FastTextLID

        lid = FastTextLID(settings["languages"])
        lid._model = _language_model(settings["language_model"], endpoint)  # what its `model` property would download
        block = LanguageFilter(settings["languages"], settings.get("language_threshold", 0.65))
        block.model = lid
        filters.append(wrap(block, "language"))
    splitter = _splitter() if settings.get("gopher") or settings.get("c4") else None
    if settings.get("gopher"):
        from datatrove.pipeline.filters import GopherQualityFilter

        filters.append(wrap(GopherQualityFilter(language=splitter)))
    if settings.get("c4"):
        from datatrove.pipeline.filters import C4QualityFilter

        filters.append(wrap(C4QualityFilter(language=splitter), "c4_"))
    return filters


def apply(filters: list[Filter], text: str) -> tuple[str | None, str]:
    """The text after every filter, or None and the first refusal's reason."""
    for f in filters:
        text, why = f(text)
        if text is None:
            return None, why
    return text, ""
