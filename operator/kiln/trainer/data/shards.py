"""The file names in a folder of token shards: `kiln data prepare` (kiln.trainer.data.prepare) writes them and data.uri
(kiln.trainer.data.loader) reads them. It imports nothing, so the trainer gets them without loading prepare's chat code and
jinja2 before its first step (a restart pays every import again: docs/resilience.md)."""

TOKENS_PREFIX = "tokens-"  # tokens-NNNNN.npy: token ids
MASK_PREFIX = "mask-"  # chat data: mask-NNNNN.npy holds the loss mask of tokens-NNNNN.npy, one byte per token
# docs-NNNNN.idx: the token offsets in tokens-NNNNN.npy where documents start (data.packing), an int64 array in .npy
# format; not named *.npy so that a trainer from before it existed, which reads every *.npy as tokens, skips it
DOCS_PREFIX, DOCS_SUFFIX = "docs-", ".idx"
