"""Packed rows (data.packing): whole documents, several to a row, instead of fixed windows that cut through them.

A folder of token shards is one stream of tokens in file-name order; `docs-N.idx` beside `tokens-N.npy` (kiln data
prepare writes it) lists where each document starts in that shard, so a document may run on into the next shard.

Pieces: a text document of n tokens longer than a row (seq_len + 1 tokens) is cut into pieces of at most
seq_len + 1 tokens that overlap by one token, exactly as the unpacked windows do, so every one of its n - 1
next-token predictions is made once. A chat conversation is never cut (a reply without its prompt teaches the wrong
thing): one longer than a row is refused, naming model.seqLen and the shard.

Rows (`plan_rows`): best-fit decreasing. Pieces are taken longest first (ties in a seeded random order), each into
the open row with the least room that still fits it, else into a new row. The plan is a pure function of (the data,
seq_len, the seed) and is the same on every rank; the loader then visits the rows in its seeded order
(kiln.trainer.data.loader.SeededOrder), so a row is a sample like an unpacked window and a resumed run, at any
world size, sees the same rows. Every epoch visits the same rows, in a new order.

A row (`pack_row`): the pieces back to back, then padding (token 0) to seq_len + 1 tokens; inputs are tokens
0..seq_len-1, targets tokens 1..seq_len. A target carries loss only inside its own piece (and, for chat, when it is
the assistant's): the last token of a piece predicts nothing, padding neither. Each piece has its own document id
(0, 1, ...) and the padding PAD_DOC, which the model's attention keeps apart (kiln.trainer.model.documents).
"""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np
import torch

from kiln.errors import KilnError
from kiln.trainer.data.shards import DOCS_PREFIX, DOCS_SUFFIX, TOKENS_PREFIX
from kiln.trainer.model.loss import IGNORE

PAD_DOC = -1  # the document id of a row's padding: a document of its own, so every query sees at least itself


def document_starts(uri: str, files: list[Path], sizes: list[int]) -> np.ndarray:
    """The global token offsets at which documents start, from each shard's docs file (sorted offsets within the
    shard); KilnError naming the file when one is missing or not a sorted list of offsets inside its shard."""
    starts, offset = [np.zeros(1, dtype=np.int64)], 0
    for f, size in zip(files, sizes):
        docs_file = f.with_name(DOCS_PREFIX + f.name.removeprefix(TOKENS_PREFIX)).with_suffix(DOCS_SUFFIX)
        if not docs_file.exists():
            raise KilnError(f"data.uri {uri}: {f.name} has no {docs_file.name}: data.packing needs the document "
                            "boundaries that kiln data prepare writes; prepare the folder again")
        try:
            local = np.load(docs_file, allow_pickle=False)
        except (ValueError, OSError) as err:
            raise KilnError(f"data.uri {uri}: {docs_file.name} is not a .npy array ({err})") from None
        if local.ndim != 1 or local.dtype.kind not in "iu" or (len(local) and (
                local[0] < 0 or local[-1] >= size or np.any(np.diff(local.astype(np.int64)) <= 0))):
            raise KilnError(f"data.uri {uri}: {docs_file.name} must hold increasing token offsets inside "
                            f"{f.name} ({size} tokens); prepare the folder again")
        starts.append(local.astype(np.int64) + offset)
        offset += size
    return np.unique(np.concatenate(starts))


def pieces(starts: np.ndarray, total: int, seq_len: int, *, split: bool) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of every piece of the documents that begin at `starts` in a stream of `total` tokens.
    split False (chat): a document longer than seq_len + 1 raises ValueError(its index). A document of one token
    has no prediction and gives no piece."""
    ends = np.append(starts[1:], total)
    lengths = ends - starts
    if not split:
        too_long = np.flatnonzero(lengths > seq_len + 1)
        if len(too_long):
            raise ValueError(int(too_long[0]))
        keep = lengths >= 2
        return starts[keep], lengths[keep]
    count = np.where(lengths >= 2, -(-(lengths - 1) // seq_len), 0)  # ceil((n - 1) / seq_len) pieces
    first = np.repeat(starts, count)
    k = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)  # piece number within its document
    piece_starts = first + k * seq_len
    return piece_starts, np.minimum(piece_starts + seq_len + 1, np.repeat(ends, count)) - piece_starts


def plan_rows(lengths: np.ndarray, capacity: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing: (pieces in row order, row bounds) so that row r holds order[bounds[r]:bounds[r + 1]]."""
    n = len(lengths)
    shuffled = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    placing = shuffled[np.argsort(-lengths[shuffled], kind="stable")]  # longest first, ties in seeded order
    rooms: list[int] = []  # the distinct room sizes that open rows have, sorted
    open_rows: dict[int, list[int]] = {}  # room -> rows with that much room
    row_of = np.empty(n, dtype=np.int64)
    # Pieces that leave no room for another (a long document's full pieces) each open a row, and come first:
    # placed at once, as the loop would place them; the loop sees only the pieces that share rows.
    rows = int(np.count_nonzero(lengths > capacity - 2))
    row_of[placing[:rows]] = np.arange(rows)
    for piece, length in zip(placing[rows:].tolist(), lengths[placing[rows:]].tolist()):
        i = bisect.bisect_left(rooms, length)
        if i < len(rooms):  # the least room that fits
            room = rooms[i]
            row = open_rows[room].pop()
            if not open_rows[room]:
                del open_rows[room], rooms[i]
        else:
            row, room, rows = rows, capacity, rows + 1
        row_of[piece] = row
        left = room - length
        if left >= 2:  # a piece has at least two tokens
            if left not in open_rows:
                bisect.insort(rooms, left)
                open_rows[left] = []
            open_rows[left].append(row)
    order = placing[np.argsort(row_of[placing], kind="stable")]  # each row's pieces in the order they were placed
    bounds = np.searchsorted(row_of[order], np.arange(rows + 1))
    return order, bounds


def pack_row(tokens: list[np.ndarray], masks: list[np.ndarray] | None, capacity: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, doc_ids), each of capacity - 1, from the pieces' tokens (and chat loss masks)."""
    row = np.zeros(capacity, dtype=np.int64)
    docs = np.full(capacity, PAD_DOC, dtype=np.int64)
    keep = np.zeros(capacity, dtype=np.bool_)  # keep[i]: token i is a target that carries loss
    at = 0
    for k, piece in enumerate(tokens):
        n = len(piece)
        row[at:at + n], docs[at:at + n] = piece, k
        keep[at + 1:at + n] = True if masks is None else masks[k][1:]
        at += n
    targets = np.where(keep[1:], row[1:], IGNORE)
    return torch.from_numpy(row[:-1].copy()), torch.from_numpy(targets), torch.from_numpy(docs[:-1].copy())


class PackedSamples:
    """Rows of whole documents over token shards: sample i is `row(i)`, (inputs, targets, doc_ids)."""

    packed = masked = True  # targets carry IGNORE: the loss is averaged over the global batch's real targets

    def __init__(self, arrays: list[np.ndarray], starts: np.ndarray, seq_len: int, seed: int, *,
                 masks: list[np.ndarray] | None = None, uri: str = "", names: list[str] | None = None):
        self.arrays, self.masks, self.seq_len = arrays, masks, seq_len
        self.offsets = np.cumsum([0] + [len(a) for a in arrays]).tolist()
        try:
            self.starts, self.lengths = pieces(starts, self.offsets[-1], seq_len, split=masks is None)
        except ValueError as err:
            raise KilnError(self._too_long(uri, names, starts, int(err.args[0]))) from None
        if not len(self.starts):
            raise KilnError(f"data.uri {uri}: no document of two or more tokens to pack")
        self.order, self.bounds = plan_rows(self.lengths, seq_len + 1, seed)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def _too_long(self, uri: str, names: list[str] | None, starts: np.ndarray, doc: int) -> str:
        at = int(starts[doc])
        length = int((starts[doc + 1] if doc + 1 < len(starts) else self.offsets[-1]) - at)
        shard = bisect.bisect_right(self.offsets, at) - 1
        where = f"{names[shard]} at token {at - self.offsets[shard]}" if names else f"token {at}"
        return (f"model.seqLen {self.seq_len}: data.packing keeps conversations whole, and data.uri {uri} holds one "
                f"of {length} tokens ({where}), more than seqLen + 1; raise model.seqLen to at least {length - 1}")

    def _span(self, arrays: list[np.ndarray], start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream, across a shard boundary when the piece runs on."""
        parts, end = [], start + length
        shard = bisect.bisect_right(self.offsets, start) - 1
        while start < end:
            stop = min(end, self.offsets[shard + 1])
            parts.append(np.asarray(arrays[shard][start - self.offsets[shard]:stop - self.offsets[shard]]))
            start, shard = stop, shard + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def row(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chosen = self.order[self.bounds[index]:self.bounds[index + 1]]
        spans = [(int(self.starts[p]), int(self.lengths[p])) for p in chosen]
        tokens = [self._span(self.arrays, s, n).astype(np.int64) for s, n in spans]
        masks = None if self.masks is None else [self._span(self.masks, s, n).astype(np.bool_) for s, n in spans]
        return pack_row(tokens, masks, self.seq_len + 1)
