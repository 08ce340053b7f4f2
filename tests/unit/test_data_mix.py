"""data.sources: several datasets drawn in fixed proportions, deterministic and resumable at any world size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.api.spec import DataSpec
from kiln.errors import KilnError
from kiln.trainer.data.loader import MIX_BLOCK, GlobalBatchLoader, MixedSamples, TokenSamples, block_counts, open_data

SEQ = 8


def tagged(tag: int, samples: int) -> TokenSamples:
    """A source whose sample i is [tag, i, i, ...]: every drawn row says where it came from and which it was."""
    rows = np.stack([np.r_[tag, np.full(SEQ, i)] for i in range(samples)]).astype(np.int64)
    return _Rows(rows)


class _Rows(TokenSamples):
    def __init__(self, rows: np.ndarray):
        self.rows, self.seq_len, self.vocab_size = rows, SEQ, 1 << 20

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, index: int) -> torch.Tensor:
        return torch.from_numpy(self.rows[index])


def mix(weights=(3, 1), sizes=(900, 250), seed=5) -> MixedSamples:
    return MixedSamples([tagged(k, n) for k, n in enumerate(sizes)], list(weights), [f"s{k}" for k in range(len(sizes))],
                        seed)


def test_block_counts_follow_the_weights_and_fill_the_block():
    assert block_counts([3, 1]) == [750, 250]
    assert block_counts([1, 1, 1]) == [334, 333, 333]
    assert sum(block_counts([0.7, 0.2, 0.1, 1e-2])) == MIX_BLOCK


def test_a_source_too_light_for_one_sample_per_block_is_refused():
    with pytest.raises(KilnError, match="s1 weigh less than 1/1000"):
        mix(weights=(10_000, 1))


def test_every_block_holds_the_exact_shares_and_each_source_is_read_without_repeats():
    m = mix()
    drawn = [m.get(i) for i in range(4 * MIX_BLOCK)]
    tags = [int(row[0]) for row in drawn]
    for b in range(4):
        block = tags[b * MIX_BLOCK:(b + 1) * MIX_BLOCK]
        assert block.count(0) == 750 and block.count(1) == 250
    assert m.drawn(4 * MIX_BLOCK) == {"s0": 3000, "s1": 1000}
    # source 0 (900 samples): its first 900 draws are a permutation of all of them, then a new epoch starts
    firsts = [int(row[1]) for row, tag in zip(drawn, tags) if tag == 0][:900]
    assert sorted(firsts) == list(range(900))
    # the shares inside a block are spread out, not 750 of one then 250 of the other
    assert 0 < tags[:100].count(1) < 100


def test_the_realised_mix_counts_partial_blocks_exactly():
    m = mix()
    tags = [int(m.get(i)[0]) for i in range(MIX_BLOCK + 123)]
    assert m.drawn(MIX_BLOCK + 123) == {"s0": tags.count(0), "s1": tags.count(1)}


def test_same_seed_same_stream_other_seed_other_stream():
    a, b, c = mix(seed=5), mix(seed=5), mix(seed=6)
    rows = lambda m: torch.stack([m.get(i) for i in range(300)])  # noqa: E731
    assert torch.equal(rows(a), rows(b)) and not torch.equal(rows(a), rows(c))


def test_a_resumed_mix_at_another_world_size_draws_the_same_batches():
    """Two batches on one rank, then a checkpoint, then two more on 4 data-parallel ranks = four on one."""
    global_batch = 64
    whole = GlobalBatchLoader(mix(), seed=5)
    expected = [whole.next_batch(global_batch)[0] for _ in range(4)]

    first = GlobalBatchLoader(mix(), seed=5)
    got = [first.next_batch(global_batch)[0] for _ in range(2)]
    state = json.loads(json.dumps(first.state_dict()))  # as trainer.json carries it
    ranks = [GlobalBatchLoader(mix(), seed=5, dp_rank=r, dp_size=4) for r in range(4)]
    for loader in ranks:
        loader.load_state_dict(state)
    for _ in range(2):
        got.append(torch.cat([loader.next_batch(global_batch)[0] for loader in ranks]))
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert whole.mix() == ranks[0].mix() and whole.mix()["s0"] == pytest.approx(0.75, abs=0.05)


def test_open_data_mixes_token_shard_folders_and_names_a_broken_source(tmp_path: Path):
    for name, fill in (("web", 1), ("code", 2)):
        (tmp_path / name).mkdir()
        np.save(tmp_path / name / "000.npy", np.full(200 * SEQ + 1, fill, dtype=np.uint16))
    data = DataSpec.model_validate({"sources": [{"uri": f"file://{tmp_path}/web/", "weight": 1},
                                                {"uri": f"file://{tmp_path}/code/", "weight": 1}]})
    source = open_data(data, seq_len=SEQ, vocab_size=256, seed=0)
    loader = GlobalBatchLoader(source, seed=0)
    inputs, _ = loader.next_batch(1000)
    assert sorted(np.unique(inputs[:, 0].numpy()).tolist()) == [1, 2]
    assert loader.mix() == {f"file://{tmp_path}/web/": 0.5, f"file://{tmp_path}/code/": 0.5}

    broken = DataSpec.model_validate({"sources": [{"uri": f"file://{tmp_path}/web/", "weight": 1},
                                                  {"uri": f"file://{tmp_path}/missing/", "weight": 1}]})
    with pytest.raises(KilnError, match=r"data.sources\[1\]: data.uri file://.*/missing/: no such folder"):
        open_data(broken, seq_len=SEQ, vocab_size=256, seed=0)
