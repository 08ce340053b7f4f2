"""`kiln data prepare`'s cleaning: normalising (Unicode NFC, \\r\\n → \\n, surrounding whitespace) a text or a
conversation's messages, and near-duplicates by MinHash (dedup minhash)."""

from __future__ import annotations

import unicodedata

from kiln.trainer.data.chat import check_messages


def normalise(text: str) -> str:
    return unicodedata.normalize("NFC", text.replace("\r\n", "\n")).strip()


def normalise_messages(messages) -> list[dict]:
    """A conversation's messages as {role, content} with each content normalised (chat.check_messages checks
    the shape first; ChatRefused says what is wrong)."""
    check_messages(messages)
    return [{"role": m["role"], "content": normalise(m["content"])} for m in messages]


MINHASH_PERMUTATIONS = 128
SHINGLE_WORDS = 5


def minhash(text: str):
    """The datasketch MinHash of a text's lower-cased word 5-gram shingles (here and in the cluster stages)."""
    from datasketch import MinHash

    words = text.lower().split()
    shingles = {" ".join(words[i:i + SHINGLE_WORDS]).encode() for i in range(max(1, len(words) - SHINGLE_WORDS + 1))}
    m = MinHash(num_perm=MINHASH_PERMUTATIONS, seed=1)
    m.update_batch(shingles)
    return m


class NearDuplicates:
    """MinHash + LSH (the `datasketch` library) over word 5-gram shingles of the lower-cased text: a document
    whose estimated Jaccard similarity to one already kept reaches `threshold` is a near-duplicate."""

    def __init__(self, threshold: float):
        from datasketch import MinHashLSH

        self.lsh = MinHashLSH(threshold=threshold, num_perm=MINHASH_PERMUTATIONS)
        self.kept = 0

    def seen_before(self, text: str) -> bool:
        m = minhash(text)
        if self.lsh.query(m):
            return True
        self.lsh.insert(str(self.kept), m)
        self.kept += 1
        return False
