"""data.format chat: conversations rendered with the model's chat template in jinja2's sandbox, the assistant mask
checked against transformers' own `apply_chat_template(..., return_assistant_tokens_mask=True)`, `kiln data
prepare --format chat` shards and masks, the loader's IGNORE targets, the loss skipping them, and the errors a
user gets for a missing or broken template, unprepared data or a spec that cannot work."""

from __future__ import annotations

import bisect
import json

import numpy as np
import pytest
import torch

from kiln.api import TrainingSpec
from kiln.cli.main import main
from kiln.errors import KilnError
from kiln.trainer.data.chat import ChatRefused, ChatRenderer, ChatTemplate, load_chat_template, token_mask
from kiln.trainer.data.loader import GlobalBatchLoader, open_source
from kiln.trainer.model.loss import IGNORE
from kiln.trainer.data.prepare import prepare
from tests.chat_models import CONVERSATIONS, LLAMA3_STYLE, WITHOUT_GENERATION, save_chat_folder, transformers_encoding


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {"generation": save_chat_folder(root / "generation"),
            "plain": save_chat_folder(root / "plain", WITHOUT_GENERATION)}


@pytest.mark.parametrize("variant", ["generation", "plain"])
def test_assistant_mask_matches_transformers(folders, variant):
    """With {% generation %} blocks kiln reads them; without, it diffs incremental renderings: both give
    transformers' ids and mask (taken from the template with generation blocks)."""
    from tokenizers import Tokenizer

    renderer = ChatRenderer(load_chat_template(f"file://{folders[variant]}"))
    assert renderer.has_generation == (variant == "generation")
    tok = Tokenizer.from_file(str(folders[variant] / "tokenizer.json"))
    for conversation in CONVERSATIONS:
        want_ids, want_mask = transformers_encoding(folders["generation"], conversation)
        text, spans = renderer.assistant_spans(conversation)
        enc = tok.encode(text, add_special_tokens=False)
        assert enc.ids == want_ids
        assert token_mask(enc.offsets, spans) == want_mask
        assert 0 < sum(want_mask) < len(want_mask)


def write_conversations(folder, records: list) -> None:
    folder.mkdir()
    (folder / "c.jsonl").write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records))


def test_prepare_chat_writes_the_template_ids_and_masks_the_loader_ignores(tmp_path, folders, capsys):
    write_conversations(tmp_path / "src", [
        *({"messages": c} for c in CONVERSATIONS),
        {"messages": CONVERSATIONS[0]},  # duplicate
        {"messages": [{"role": "user", "content": "no reply"}]},  # no_assistant_turn
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},  # invalid_message
        {"text": "not a conversation"},  # missing_field
        "{broken",  # invalid_json
    ])
    out = tmp_path / "out"
    assert main(["data", "prepare", "--format", "chat", "--input", str(tmp_path / "src"),
                 "--tokenizer", f"file://{folders['plain']}", "--output", f"file://{out}",
                 "--shard-tokens", "40"]) == 0
    assert "2 of 7 documents" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["removed"] == {"duplicate": 1, "invalid_json": 1, "invalid_message": 1, "missing_field": 1,
                                   "no_assistant_turn": 1}
    assert manifest["format"] == "chat" and manifest["chat_template"].endswith("tokenizer_config.json")
    want = [transformers_encoding(folders["generation"], c) for c in CONVERSATIONS]
    want_ids = [i for ids, _ in want for i in ids]
    want_mask = [m for _, mask in want for m in mask]
    names = [s["name"] for s in manifest["shards"]]
    tokens = np.concatenate([np.load(out / n) for n in names])
    masks = np.concatenate([np.load(out / n.replace("tokens-", "mask-")) for n in names])
    assert tokens.tolist() == want_ids and masks.tolist() == want_mask
    assert manifest["assistant_tokens"] == sum(want_mask) == sum(s["assistant_tokens"] for s in manifest["shards"])

    # the trainer's loader: targets outside the assistant's turns are IGNORE, the others the next token
    seq = 8
    source = open_source(f"file://{out}", seq_len=seq, vocab_size=400, seed=0, chat=True)
    loader = GlobalBatchLoader(source, seed=0)
    inputs, targets = loader.next_batch(4)
    for row in range(4):
        sample = loader._sample_id(row)
        shard = bisect.bisect_right(source.starts, sample) - 1  # windows do not cross shards
        offset = (sample - source.starts[shard]) * seq
        ids = np.load(out / names[shard])[offset:offset + seq + 1].astype(np.int64)
        mask = np.load(out / names[shard].replace("tokens-", "mask-"))[offset:offset + seq + 1]
        assert inputs[row].tolist() == ids[:-1].tolist()
        assert targets[row].tolist() == np.where(mask[1:] == 1, ids[1:], IGNORE).tolist()
    # data.format text reads the same folder with every target
    _, plain = GlobalBatchLoader(open_source(f"file://{out}", seq_len=seq, vocab_size=400, seed=0), seed=0).next_batch(4)
    assert (plain != IGNORE).all()


def test_chat_data_without_masks_is_refused(tmp_path, folders):
    write_conversations(tmp_path / "src", [{"text": "plain text, prepared as documents"}])
    prepare([str(tmp_path / "src")], tokenizer_uri=f"file://{folders['plain']}", output=f"file://{tmp_path / 'out'}",
            log=lambda m: None)
    with pytest.raises(KilnError, match="tokens-00000.npy has no mask-00000.npy.*--format chat"):
        open_source(f"file://{tmp_path / 'out'}", seq_len=4, vocab_size=400, seed=0, chat=True)


def test_template_problems_are_named(tmp_path, folders):
    def renderer(text: str, max_chars: int = 10_000) -> ChatRenderer:
        return ChatRenderer(ChatTemplate("/m/tokenizer_config.json", text, {}), max_chars=max_chars)

    with pytest.raises(KilnError, match=r"chat template /m/tokenizer_config.json: line 1: .*endfor"):
        renderer("{% for m in messages %}{{ m.content }}")
    conversation = CONVERSATIONS[0]
    # untrusted: Python internals and mutation of the data are refused by the sandbox, for every conversation
    for escape in ("{{ messages.__class__.__mro__[1].__subclasses__() }}",
                   "{% set _ = messages.append(1) %}{{ messages }}"):
        with pytest.raises(KilnError, match="tokenizer_config.json: refused by the sandbox"):
            renderer(escape).assistant_spans(conversation)
    with pytest.raises(KilnError, match="tokenizer_config.json: TypeError"):  # a template bug, not the data's
        renderer("{{ messages[0].content + 1 }}").assistant_spans(conversation)
    # per conversation: counted by kiln data prepare
    with pytest.raises(ChatRefused, match="only user turns") as refused:
        renderer("{{ raise_exception('only user turns') }}").assistant_spans(conversation)
    assert refused.value.reason == "template_refused"
    for huge in ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",  # bounded output: stops past max_chars
                 "{{ 'x' * 1000000000 }}", "{{ [1] * 1000000000 }}"):  # one value repeated past it: never built
        with pytest.raises(ChatRefused) as refused:
            renderer(huge).assistant_spans(conversation)
        assert refused.value.reason == "too_long", huge
    with pytest.raises(KilnError, match="refused by the sandbox: the exponent 1000000000 is past 4096"):
        renderer("{{ 2 ** 1000000000 }}").assistant_spans(conversation)
    with pytest.raises(ChatRefused) as refused:  # renders only the last message: not an extension of the prefix
        renderer("{{ messages[-1].content }}").assistant_spans(conversation)
    assert refused.value.reason == "template_not_incremental"
    # a tokenizer without a template
    bare = save_chat_folder(tmp_path / "bare", template=None)
    with pytest.raises(KilnError, match=r"no chat template \(neither .*chat_template.jinja nor a chat_template in "
                                        r".*tokenizer_config.json\)"):
        load_chat_template(f"file://{bare}")
    # transformers' newer layout: chat_template.jinja beside the config takes precedence
    (bare / "chat_template.jinja").write_text(LLAMA3_STYLE)
    assert load_chat_template(f"file://{bare}").source.endswith("chat_template.jinja")


def spec(data: dict, model: dict | None = None) -> dict:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "c"},
            "spec": {"model": model or {"preset": "tiny"}, "data": data}}


def test_spec_rules_and_run_refuse_chat_that_cannot_work(tmp_path, folders):
    from pydantic import ValidationError

    from kiln.trainer.model import hf_folder as hf

    cases = [({"format": "chat", "uri": "file:///d/", "tokenizer": "byte"}, "spec.data.format: data.format chat renders"),
             ({"format": "chat", "uri": "synthetic", "tokenizer": "file:///t/"}, "must be a folder"),
             ({"format": "chat", "sources": [{"uri": "builtin:pydoc", "weight": 1}], "tokenizer": "file:///t/"},
              "must be a folder")]
    for data, message in cases:
        with pytest.raises(ValidationError, match=message):
            TrainingSpec.model_validate(spec(data))
    ok = TrainingSpec.model_validate(spec({"format": "chat", "uri": "file:///d/", "tokenizer": f"file://{folders['plain']}"}))
    assert ok.spec.data.format == "chat"
    # kiln run and the trainer: the tokenizer must have a chat template
    bare = save_chat_folder(tmp_path / "bare", template=None)
    doc = TrainingSpec.model_validate(spec({"format": "chat", "uri": "file:///d/", "tokenizer": f"file://{bare}"}))
    dims = hf.resolve_dims(doc.spec)
    with pytest.raises(KilnError, match="no chat template"):
        hf.training_tokenizer(doc.spec, dims.model_copy(update={"vocab_size": 512}))
    assert hf.training_tokenizer(ok.spec, dims.model_copy(update={"vocab_size": 512})) is not None


@pytest.mark.parametrize("kernel", ["model.cross_entropy", "kernels.fused_linear_cross_entropy"])
def test_ignored_targets_add_nothing_to_the_loss_or_its_gradient(kernel):
    """The unfused (TP/PP) and fused loss paths: an IGNORE target's position gets exactly zero gradient, the loss
    is the mean over the others, and a microbatch with none left gives 0, not NaN."""
    from kiln.trainer.model import kernels
    from kiln.trainer.model.transformer import cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(2, 6, 8, requires_grad=True)
    weight = torch.randn(16, 8)
    targets = torch.randint(0, 16, (2, 6))
    targets[0, :4] = IGNORE
    targets[1, 5] = IGNORE

    def loss_of(t):
        if kernel == "model.cross_entropy":
            return cross_entropy(hidden @ weight.t(), t)
        return kernels.fused_linear_cross_entropy(hidden, weight, t)

    loss = loss_of(targets)
    loss.backward()
    keep = targets != IGNORE
    want = torch.nn.functional.cross_entropy((hidden @ weight.t())[keep], targets[keep])
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert (hidden.grad[~keep] == 0).all() and (hidden.grad[keep].abs().sum(-1) > 0).all()
    hidden.grad = None
    none = loss_of(torch.full_like(targets, IGNORE))
    none.backward()
    assert none.item() == 0 and (hidden.grad == 0).all()


def test_kiln_eval_scores_chat_data_on_the_assistant_tokens(tmp_path, folders):
    """kiln eval's mean loss of chat shards: the mean over all assistant tokens of the batches (each microbatch
    weighted by its count), which a mean of microbatch means would not give."""
    from kiln.api import ModelDims
    from kiln.trainer.evaluate import mean_loss
    from kiln.trainer.model.transformer import build_model

    write_conversations(tmp_path / "src", [{"messages": c} for c in CONVERSATIONS * 4])
    prepare([str(tmp_path / "src")], tokenizer_uri=f"file://{folders['plain']}", output=f"file://{tmp_path / 'out'}",
            format="chat", dedup="none", log=lambda m: None)
    dims = ModelDims(dim=32, layers=1, heads=2, kv_heads=2, vocab_size=384, seq_len=16, ffn_dim=64)
    model = build_model(dims)
    model.to_empty(device="cpu")
    model.init_weights(0)
    loader = GlobalBatchLoader(open_source(f"file://{tmp_path / 'out'}", seq_len=16, vocab_size=384, seed=0, chat=True),
                               seed=0)
    with torch.no_grad():
        loss, tokens = mean_loss(model, loader, batches=2, global_batch=4, micro_batch=1, device=torch.device("cpu"))
        loader.samples_seen = 0
        batches = [loader.next_batch(4) for _ in range(2)]
        inputs, targets = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        logits = model(inputs)
    keep = targets != IGNORE
    want = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
    assert tokens == int(keep.sum()) and loss == pytest.approx(want.item(), rel=1e-5)
    per_row = [torch.nn.functional.cross_entropy(logits[r][keep[r]], targets[r][keep[r]]) for r in range(8)
               if keep[r].any()]
    assert abs(torch.stack(per_row).mean().item() - want.item()) > 1e-3  # the rows' masks differ enough to tell


def test_chat_batches_resume_at_another_world_size(tmp_path, folders):
    """The masks are a pure function of the sample, like its tokens: a run resumed from the cursor on 2
    data-parallel ranks reads the targets (and IGNOREs) a 1-rank run would have read."""
    write_conversations(tmp_path / "src", [{"messages": c} for c in CONVERSATIONS * 3])
    prepare([str(tmp_path / "src")], tokenizer_uri=f"file://{folders['plain']}", output=f"file://{tmp_path / 'out'}",
            format="chat", dedup="none", log=lambda m: None)

    def loader(rank: int = 0, size: int = 1) -> GlobalBatchLoader:
        source = open_source(f"file://{tmp_path / 'out'}", seq_len=8, vocab_size=400, seed=5, chat=True)
        return GlobalBatchLoader(source, seed=5, dp_rank=rank, dp_size=size)

    one = loader()
    one.next_batch(4)
    state = one.state_dict()
    want_inputs, want_targets = one.next_batch(4)
    halves = []
    for rank in range(2):
        resumed = loader(rank, 2)
        resumed.load_state_dict(state)
        halves.append(resumed.next_batch(4))
    assert torch.equal(torch.cat([h[0] for h in halves]), want_inputs)
    assert torch.equal(torch.cat([h[1] for h in halves]), want_targets)
    assert (want_targets == IGNORE).any() and (want_targets != IGNORE).any()
