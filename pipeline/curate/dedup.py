"""Exact and near-duplicate detection on the prompt side of conversations.

The dedup text of a conversation is its system + user turns, each normalized (lower case, whitespace
runs collapsed to one space) and joined by newlines: assistant turns are rewritten by `regen`, so two
records that ask the same thing are duplicates whatever their answers.

Exact: `exact_key` = blake2b-128 of the dedup text; the first occurrence (sources in config order,
records in file order) is kept.

Near: MinHash over word 3-grams, indexed with datasketch's `MinHashLSH`; a conversation whose LSH
candidates include an earlier kept one with estimated Jaccard >= threshold is a near duplicate of it.
Signatures are computed for a whole chunk of texts at once with numpy (`minhash_signatures`), using
datasketch's own `affine32` permutations and pre-mix, so every row is bit-identical to
`datasketch.MinHash(num_perm, seed=MINHASH_SEED, hashfunc=identity).update_batch(shingle_hashes)`
(tests/pipeline/test_curate_dedup.py checks this) -- only the per-shingle Python loop is gone.
"""

from __future__ import annotations

import hashlib

import numpy as np
from datasketch import LeanMinHash, MinHash, MinHashLSH
from datasketch.minhash import _fmix

from pipeline.log import progress

MINHASH_SEED = 1          # datasketch's default permutation seed
MINHASH_SCHEME = "affine32"
SHINGLE_WORDS = 3         # word n-grams: one changed word in a 50-word prompt keeps Jaccard ~0.89
# LSH band/row choice favours recall (datasketch's weights: false positives 0.1, false negatives 0.9);
# candidates are then confirmed with the signature estimate, which removes the false positives.
LSH_WEIGHTS = (0.1, 0.9)

_U64 = np.uint64
_GRAM_MUL = (_U64(0x9E3779B97F4A7C15), _U64(0xC2B2AE3D27D4EB4F))  # word-position multipliers
_MAX_ROWS = 1 << 10                  # shingles per block in minhash_signatures (fits in cache)


def normalize(text: str) -> str:
    """Lower case, whitespace runs -> one space, no leading/trailing space (never contains '\\n')."""
    return " ".join(text.lower().split())


def dedup_text(messages: list[dict]) -> str:
    """The prompt side of a conversation (system + user turns), normalized, one line per turn."""
    return "\n".join(normalize(m["content"]) for m in messages if m["role"] != "assistant")


def exact_key(text: str) -> bytes:
    """16-byte digest of a dedup text (`schema.KEY_BYTES`)."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


_WORD_HASHES: dict[str, int] = {}  # per-process cache of `_word_hash` (a pure function)
_WORD_CACHE_MAX = 1 << 21


def _word_hash(word: str) -> int:
    """Stable 64-bit hash of one word (Python's `hash` is salted per process, so not usable here)."""
    return int.from_bytes(hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest(), "little")


def _hash_words(tokens: list[str]) -> np.ndarray:
    """uint64 hashes of `tokens`, hashing each distinct word once."""
    if len(_WORD_HASHES) > _WORD_CACHE_MAX:
        _WORD_HASHES.clear()
    for word in set(tokens).difference(_WORD_HASHES):
        _WORD_HASHES[word] = _word_hash(word)
    return np.fromiter(map(_WORD_HASHES.__getitem__, tokens), dtype=_U64, count=len(tokens))


def shingle_hashes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """uint32 hashes of the word 3-grams of each text, for a batch of texts at once.

    Returns (hashes [n_shingles] uint32, offsets [len(texts)+1] int64): the shingles of text i are
    hashes[offsets[i]:offsets[i+1]]. Words are `str.split()` tokens. A text with fewer than 3 words has
    one shingle (its words); an empty text has one constant shingle, so every text has >= 1 shingle and
    a defined signature.
    """
    n = len(texts)
    tokens: list[str] = []
    words_per_doc = np.empty(n, dtype=np.int64)
    for i, text in enumerate(texts):
        doc_tokens = text.split()
        words_per_doc[i] = len(doc_tokens)
        tokens += doc_tokens
    words = _hash_words(tokens)
    word_doc = np.repeat(np.arange(n), words_per_doc)
    first_word = np.zeros(n, dtype=np.int64)
    np.cumsum(words_per_doc[:-1], out=first_word[1:])

    # gram i = words i, i+1, i+2 of the same doc; missing neighbours (short docs) count as 0
    size = words.size
    padded = np.concatenate((words, np.zeros(SHINGLE_WORDS - 1, dtype=_U64)))
    doc_padded = np.concatenate((word_doc, np.full(SHINGLE_WORDS - 1, -1)))
    same1 = doc_padded[1 : size + 1] == word_doc
    same2 = doc_padded[2 : size + 2] == word_doc
    gram = words ^ (padded[1 : size + 1] * same1 * _GRAM_MUL[0]) ^ (padded[2 : size + 2] * same2 * _GRAM_MUL[1])
    # keep the grams that start a full 3-gram, plus the first word of docs with 1-2 words
    short_doc_start = (words_per_doc[word_doc] < SHINGLE_WORDS) & (np.arange(size) == first_word[word_doc])
    keep = same2 | short_doc_start
    hashes = (_fmix(gram[keep], 64) >> _U64(32)).astype(np.uint32)
    gram_doc = word_doc[keep]

    counts = np.bincount(gram_doc, minlength=n)
    empty = np.flatnonzero(counts == 0)
    if empty.size:  # empty texts: one constant shingle each, inserted in doc order
        hashes = np.insert(hashes, np.searchsorted(gram_doc, empty), np.uint32(0))
        counts[empty] = 1
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return hashes, offsets


def minhash_signatures(hashes: np.ndarray, offsets: np.ndarray, num_perm: int) -> np.ndarray:
    """MinHash signatures [n_texts, num_perm] uint32 from `shingle_hashes` output.

    Exactly datasketch's affine32 update: h -> fmix32(h) -> a_k * h + b_k (mod 2^32), minimum over the
    text's shingles, with (a, b) = `MinHash(num_perm, seed=MINHASH_SEED).permutations`.
    """
    a, b = MinHash(num_perm=num_perm, seed=MINHASH_SEED, scheme=MINHASH_SCHEME).permutations
    mixed = _fmix(hashes.astype(np.uint32), 32)
    n = len(offsets) - 1
    out = np.empty((n, num_perm), dtype=np.uint32)
    doc = 0
    while doc < n:  # blocks of whole docs with about _MAX_ROWS shingles
        end = int(np.searchsorted(offsets, offsets[doc] + _MAX_ROWS, side="right")) - 1
        end = min(max(end, doc + 1), n)
        lo, hi = offsets[doc], offsets[end]
        permuted = mixed[lo:hi, None] * a[None, :] + b[None, :]
        out[doc:end] = np.minimum.reduceat(permuted, offsets[doc:end] - lo, axis=0)
        doc = end
    return out


def exact_duplicates(keys: np.ndarray) -> np.ndarray:
    """For keys [N, 2] uint64 (the 16-byte digests), dup_of[N] int64: -1 for the first occurrence of a
    key, else the index of that first occurrence."""
    n = len(keys)
    order = np.lexsort((np.arange(n), keys[:, 1], keys[:, 0]))
    k = keys[order]
    new_group = np.ones(n, dtype=bool)
    new_group[1:] = (k[1:] != k[:-1]).any(axis=1)
    group_first = order[np.flatnonzero(new_group)][np.cumsum(new_group) - 1]
    dup_of = np.full(n, -1, dtype=np.int64)
    dup_of[order] = np.where(group_first == order, -1, group_first)
    return dup_of


def near_duplicates(signatures: np.ndarray, candidates: np.ndarray, threshold: float,
                    *, desc: str = "near-dedup") -> np.ndarray:
    """Near duplicates among rows `candidates` (visited in this order; earlier ones are kept).

    signatures: [N, num_perm] uint32. Returns dup_of[N] int64: -1, or the kept row this one duplicates
    (the lowest index among confirmed candidates). Rows outside `candidates` stay -1.
    """
    num_perm = signatures.shape[1]
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=LSH_WEIGHTS)
    dup_of = np.full(len(signatures), -1, dtype=np.int64)
    bar = progress(total=len(candidates), desc=desc, unit="conv")
    for step, i in enumerate(candidates.tolist()):
        if step and step % 4096 == 0:
            bar.update(4096)
        sig = signatures[i]
        sketch = LeanMinHash(seed=MINHASH_SEED, hashvalues=sig, scheme=MINHASH_SCHEME)
        found = lsh.query(sketch)
        if found:
            found = np.fromiter(found, dtype=np.int64, count=len(found))
            similar = found[(signatures[found] == sig).mean(axis=1) >= threshold]
            if similar.size:
                dup_of[i] = similar.min()
                continue
        lsh.insert(i, sketch, check_duplication=False)
    bar.update(len(candidates) - bar.n)
    bar.close()
    return dup_of
