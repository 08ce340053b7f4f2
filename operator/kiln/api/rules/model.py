"""Rules on spec.model: a complete model, from a folder or a preset, head/dimension shapes, the experts' top-k."""

from __future__ import annotations

import re

from kiln.api.layout import divisors as _divisors, model_value
from kiln.api.rules.common import Rule, cel_model, cel_model_known, check_store_uri, model_complete


def _check_model_complete(s):
    if not model_complete(s):
        missing = [f for f in ("dim", "layers", "heads", "vocabSize", "seqLen")
                   if getattr(s.model, re.sub(r"[A-Z]", lambda m: "_" + m.group(0).lower(), f)) is None]
        return f"missing: {', '.join(missing)}"
    return None


def _check_kv_heads(s):
    h, kv = model_value(s, "heads"), model_value(s, "kv_heads")
    if h is not None and kv is not None and h % kv:
        return f"got heads={h}, kvHeads={kv}; valid kvHeads: {_divisors(h)}"
    return None


def _check_dim(s):
    d, h = model_value(s, "dim"), model_value(s, "heads")
    if d is not None and h is not None and d % (2 * h):
        return f"got dim={d}, heads={h}; e.g. dim={2 * h * max(1, round(d / (2 * h)))}"
    return None


def _check_moe_top_k(s):
    moe = s.model.moe
    if moe is not None and moe.top_k is not None and moe.experts is not None and moe.top_k > moe.experts:
        return f"got topK={moe.top_k}, experts={moe.experts}"
    return None


def _check_from_preset(s):
    if s.model.from_ is not None and s.model.preset is not None:
        return f"got preset={s.model.preset!r}, from={s.model.from_!r}"
    return None


def _check_from_uri(s):
    return check_store_uri(s.model.from_)



MODEL_RULES: list[Rule] = [
    Rule("model-complete", "model",
         "set model.preset, model.from, or all of model.dim, layers, heads, vocabSize and seqLen",
         "has(self.model.preset) || has(self.model.from) || (has(self.model.dim) && has(self.model.layers) && has(self.model.heads)"
         " && has(self.model.vocabSize) && has(self.model.seqLen))",
         _check_model_complete),
    Rule("model-from-or-preset", "model.from",
         "model.from and model.preset exclude each other: the model folder's config.json sets the dimensions",
         "!has(self.model.from) || !has(self.model.preset)",
         _check_from_preset),
    Rule("model-from-scheme", "model.from",
         "model.from must be a model folder: file:///path/ or s3://bucket/prefix/",
         "!has(self.model.from) || self.model.from.startsWith('s3://') || self.model.from.startsWith('file://')",
         _check_from_uri),
    Rule("kv-heads-divide-heads", "model.kvHeads",
         "model.kvHeads must divide model.heads (grouped-query attention)",
         f"!{cel_model_known('heads', 'kv_heads')} || {cel_model('heads')} % {cel_model('kv_heads')} == 0",
         _check_kv_heads),
    Rule("dim-multiple-of-heads", "model.dim",
         "model.dim must be a multiple of 2 × model.heads (an even head size for rotary embeddings)",
         f"!{cel_model_known('dim', 'heads')} || {cel_model('dim')} % (2 * {cel_model('heads')}) == 0",
         _check_dim),
    Rule("moe-top-k", "model.moe.topK",
         "model.moe.topK must be at most model.moe.experts",
         "!has(self.model.moe) || !has(self.model.moe.topK) || !has(self.model.moe.experts)"
         " || self.model.moe.topK <= self.model.moe.experts",
         _check_moe_top_k),
]
