"""Rules on what the run reads and writes: checkpoint.uri and its interval, data.uri and data.sources, the
chat and packing formats' folders, and data.tokenizer."""

from __future__ import annotations

from kiln.api.rules.common import Rule, check_store_uri, shown
from kiln.api.spec import DEFAULT_DATA_URI


def _check_ckpt_uri(s):
    return check_store_uri(s.checkpoint.uri)


def _check_interval(s):
    v = s.checkpoint.interval_steps
    if not isinstance(v, str) and v < 1:
        return f"got {v}"
    return None


def _check_tokenizer(s):
    return None if s.data.tokenizer == "byte" else check_store_uri(s.data.tokenizer)


def _data_uri_ok(uri: str) -> bool:
    return uri == "synthetic" or uri.startswith(("builtin:", "file://", "s3://"))


def _check_data_uri(s):
    return None if _data_uri_ok(s.data.uri) else f"got {shown(s.data.uri)}"


def _check_source_uris(s):
    bad = [src.uri for src in s.data.sources if not _data_uri_ok(src.uri)]
    return f"got {shown(bad[0])}" if bad else None


_FOLDER_CEL = "{x}.startsWith('file://') || {x}.startsWith('s3://')"
# data.uri, or every data.sources uri when there are sources, is a folder
_ALL_FOLDERS_CEL = (f"(size(self.data.sources) > 0 ? self.data.sources.all(s, {_FOLDER_CEL.format(x='s.uri')})"
                    f" : ({_FOLDER_CEL.format(x='self.data.uri')}))")


def _check_chat_folders(s):
    return _check_folders(s) if s.data.format == "chat" else None


def _check_packing_folders(s):
    return _check_folders(s) if s.data.packing else None


def _check_folders(s):
    uris = [src.uri for src in s.data.sources] or [s.data.uri]
    bad = [u for u in uris if not u.startswith(("file://", "s3://"))]
    return f"got {shown(bad[0])}" if bad else None


def _check_chat_tokenizer(s):
    if s.data.format != "chat" or s.model.from_ is not None or s.data.tokenizer not in (None, "byte"):
        return None
    return f"got tokenizer={shown(s.data.tokenizer)}, no model.from"


def _check_sources_or_uri(s):
    if s.data.sources and s.data.uri != DEFAULT_DATA_URI:
        return f"got uri={shown(s.data.uri)} and {len(s.data.sources)} sources"
    return None



STORE_RULES: list[Rule] = [
    Rule("checkpoint-uri-scheme", "checkpoint.uri",
         "checkpoint.uri must start with s3:// or file://",
         "!has(self.checkpoint.uri) || self.checkpoint.uri.startsWith('s3://')"
         " || self.checkpoint.uri.startsWith('file://')",
         _check_ckpt_uri),
    Rule("checkpoint-interval", "checkpoint.intervalSteps",
         "checkpoint.intervalSteps must be a positive integer or 'auto'",
         "type(self.checkpoint.intervalSteps) == string ? self.checkpoint.intervalSteps == 'auto'"
         " : self.checkpoint.intervalSteps >= 1",
         _check_interval),
    Rule("data-uri-scheme", "data.uri",
         "data.uri must be 'synthetic', builtin:<name>, file:///path/ or s3://bucket/prefix/",
         "self.data.uri == 'synthetic' || self.data.uri.startsWith('builtin:')"
         " || self.data.uri.startsWith('file://') || self.data.uri.startsWith('s3://')",
         _check_data_uri),
    Rule("data-source-uri-scheme", "data.sources",
         "every data.sources uri must be 'synthetic', builtin:<name>, file:///path/ or s3://bucket/prefix/",
         "self.data.sources.all(s, s.uri == 'synthetic' || s.uri.startsWith('builtin:')"
         " || s.uri.startsWith('file://') || s.uri.startsWith('s3://'))",
         _check_source_uris),
    Rule("data-sources-or-uri", "data.sources",
         "data.sources replaces data.uri: leave data.uri unset when data.sources is set",
         f"size(self.data.sources) == 0 || self.data.uri == '{DEFAULT_DATA_URI}'",
         _check_sources_or_uri),
    Rule("data-chat-folders", "data.format",
         "data.format chat trains on conversations prepared with kiln data prepare --format chat: data.uri (or "
         "every data.sources uri) must be a folder, file:///path/ or s3://bucket/prefix/",
         f"self.data.format != 'chat' || {_ALL_FOLDERS_CEL}",
         _check_chat_folders),
    Rule("data-packing-folders", "data.packing",
         "data.packing packs the documents of shards prepared with kiln data prepare: data.uri (or every "
         "data.sources uri) must be a folder, file:///path/ or s3://bucket/prefix/",
         f"!self.data.packing || {_ALL_FOLDERS_CEL}",
         _check_packing_folders),
    Rule("data-chat-tokenizer", "data.format",
         "data.format chat renders conversations with a chat template: set data.tokenizer (not 'byte') or "
         "model.from to a model folder whose tokenizer has one",
         "self.data.format != 'chat' || has(self.model.from) || (has(self.data.tokenizer) && self.data.tokenizer != 'byte')",
         _check_chat_tokenizer),
    Rule("data-tokenizer", "data.tokenizer",
         "data.tokenizer must be 'byte', or a tokenizer.json or model folder at file://... or s3://...",
         "!has(self.data.tokenizer) || self.data.tokenizer == 'byte' || self.data.tokenizer.startsWith('s3://')"
         " || self.data.tokenizer.startsWith('file://')",
         _check_tokenizer),
]
