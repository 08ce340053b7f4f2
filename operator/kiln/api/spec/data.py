"""spec.data: where training tokens come from (one source or a weighted mix), their format and packing."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.api.base import ApiModel
from kiln.api.spec.limits import DEFAULT_DATA_URI


class DataSource(ApiModel):
    """One dataset of a mix (data.sources)."""

    uri: str = Field(
        ..., max_length=1024,
        description="Like data.uri: 'synthetic', 'builtin:pydoc', or a folder of token shards (file:///path/ or "
        "s3://bucket/prefix/, e.g. the output of `kiln data prepare`).",
    )
    weight: float = Field(
        ..., gt=0, le=1e6,
        description="Relative share of this source in every global batch stream: weights 3 and 1 draw 75 % and "
        "25 % of the samples. Only the ratios matter; each share must be at least 1/1000 of the total.",
    )


class DataSpec(ApiModel):
    """Where training tokens come from."""

    uri: str = Field(
        DEFAULT_DATA_URI, max_length=1024,
        description=(
            "'synthetic' (random tokens, for throughput tests), 'builtin:pydoc' (a small English corpus that ships "
            "with Python, tokenized with data.tokenizer: bytes by default), or a folder of tokenized shards: "
            "file:///path/ or s3://bucket/prefix/."
        ),
    )
    tokenizer: str | None = Field(
        None, max_length=1024,
        description="'byte' (the built-in byte tokenizer, vocabulary 256), a tokenizer.json or a model folder holding "
        "one: file://... or s3://.... Default: the model folder's tokenizer when model.from is set, else 'byte'. "
        "builtin:pydoc is tokenized with it; token shards must have been made with it. Its vocabulary must fit "
        "model.vocabSize.",
    )
    sources: list[DataSource] = Field(
        default_factory=list, max_length=16,
        description="Train on a mix of datasets in fixed proportions instead of data.uri (leave data.uri unset). "
        "The mix is deterministic and resumes at any world size; the realised shares are reported per source "
        "(metrics.jsonl data_mix, Prometheus kiln_data_source_share). All sources use data.tokenizer.",
    )
    format: Literal["text", "chat"] = Field(
        "text",
        description="text: the loss is taken on every token. chat: on the assistant's tokens only, averaged over "
        "the whole global batch; data.uri (or every data.sources uri) is a folder of conversations prepared with "
        "`kiln data prepare --format chat`, which renders them with the tokenizer's chat template and writes "
        "each shard's assistant mask. Needs data.tokenizer (or model.from) with a chat template.",
    )
    packing: bool = Field(
        False,
        description="Pack whole documents (chat: whole conversations), several to a sequence of model.seqLen, "
        "instead of cutting the token stream into windows: attention never crosses a document and positions "
        "restart at each one, so each token's loss is the one it has alone; padding carries no loss. Text "
        "documents longer than a sequence are cut into pieces; a conversation longer than model.seqLen + 1 tokens "
        "is refused. Needs a folder prepared by `kiln data prepare` (file:// or s3://), which records where "
        "documents start. Rows are planned best-fit decreasing and visited in the seeded order (docs/models.md).",
    )
