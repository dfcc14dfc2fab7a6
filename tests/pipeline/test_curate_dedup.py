"""Exact and near-duplicate removal: within and across sources, first occurrence kept, signatures
bit-identical to datasketch's own MinHash."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import yaml
from datasketch import MinHash

from pipeline.config import load_config
from pipeline.curate.dedup import (
    MINHASH_SEED, exact_duplicates, exact_key, minhash_signatures, near_duplicates, normalize, shingle_hashes,
)
from pipeline.curate.stage import run_curate


def curate_config(tmp_path, sources, **curate):
    data = {"name": "t", "runs_dir": str(tmp_path / "runs"), "curate": {"sources": sources, **curate}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def gsm8k(n: int) -> list[dict]:
    """n made-up word problems of 50-60 words: long enough that one changed word keeps Jaccard > 0.85."""
    gen = np.random.default_rng(0)
    vocab = [w + s for w in ("apple", "crate", "train", "river", "coin", "garden", "ticket", "baker", "marble", "lamp")
             for s in ("", "s", "ed", "ing", "er", "ly", "ful", "ness", "ish", "ward")] + [str(i) for i in range(100)]
    return [{"question": " ".join(gen.choice(vocab, int(gen.integers(50, 61)))).capitalize() + "?",
             "answer": f"#### {i}"} for i in range(n)]


def one_word_changed(text: str) -> str:
    words = text.split(" ")
    words[len(words) // 2] = "zebra"
    return " ".join(words)


def test_signatures_equal_datasketch_minhash_update_batch():
    texts = ["", "one", "two words", "the quick brown fox jumps over the lazy dog",
             normalize(gsm8k(1)[0]["question"]), "a\nb c d e f"]
    hashes, offsets = shingle_hashes(texts)
    sig = minhash_signatures(hashes, offsets, 64)
    assert sig.shape == (len(texts), 64) and sig.dtype == np.uint32
    for i in range(len(texts)):
        assert offsets[i + 1] > offsets[i]  # every text has a shingle
        m = MinHash(num_perm=64, seed=MINHASH_SEED, hashfunc=lambda x: x)
        m.update_batch(hashes[offsets[i]:offsets[i + 1]].tolist())
        np.testing.assert_array_equal(m.hashvalues, sig[i])


def test_signature_jaccard_tracks_word_trigram_overlap():
    q = normalize(gsm8k(1)[0]["question"])
    sig = minhash_signatures(*shingle_hashes([q, one_word_changed(q), normalize(gsm8k(2)[1]["question"])]), 128)
    near = (sig[0] == sig[1]).mean()
    other = (sig[0] == sig[2]).mean()
    assert near > 0.75 and other < 0.2


def test_exact_duplicates_point_at_the_first_occurrence():
    keys = np.array([[1, 1], [2, 2], [1, 1], [3, 3], [2, 2], [1, 1]], dtype=np.uint64)
    np.testing.assert_array_equal(exact_duplicates(keys), [-1, -1, 0, -1, 1, 0])


def test_near_duplicates_keep_the_earliest_and_skip_unrelated():
    qs = [normalize(r["question"]) for r in gsm8k(3)]
    texts = [qs[0], qs[1], one_word_changed(qs[0]), qs[2], one_word_changed(qs[1])]
    sig = minhash_signatures(*shingle_hashes(texts), 64)
    np.testing.assert_array_equal(near_duplicates(sig, np.arange(5), 0.85), [-1, -1, 0, -1, 1])
    # visiting order decides who is kept; rows outside the candidates are never touched
    np.testing.assert_array_equal(near_duplicates(sig, np.array([2, 0]), 0.85), [2, -1, -1, -1, -1])


def test_exact_key_ignores_case_and_whitespace_only():
    assert exact_key(normalize("Hello   World\n")) == exact_key(normalize("hello world"))
    assert exact_key(normalize("hello world")) != exact_key(normalize("hello, world"))


def test_stage_removes_exact_and_near_duplicates_within_and_across_sources(tmp_path):
    rs = gsm8k(6)
    a = [
        {"question": rs[0]["question"], "answer": rs[0]["answer"]},                       # a/0 kept
        {"question": rs[1]["question"], "answer": rs[1]["answer"]},                       # a/1 kept
        {"question": rs[0]["question"].upper(), "answer": "a different answer"},          # a/2 exact of a/0
        {"question": one_word_changed(rs[1]["question"]), "answer": rs[1]["answer"]},     # a/3 near of a/1
        {"question": rs[2]["question"], "answer": rs[2]["answer"]},                       # a/4 kept
    ]
    b = [
        {"messages": [{"role": "user", "content": "  " + rs[2]["question"]}, {"role": "assistant", "content": "x"}]},  # exact of a/4
        {"messages": [{"role": "user", "content": one_word_changed(rs[0]["question"])}]},                               # near of a/0
        {"messages": [{"role": "user", "content": rs[3]["question"]}]},                                                 # b/2 kept
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": rs[4]["question"]}]},    # b/3 kept
        {"messages": [{"role": "user", "content": rs[4]["question"]}]},  # exact key differs (no system), near of b/3
    ]
    sources = [{"name": "a", "path": write_jsonl(tmp_path / "a.jsonl", a)},
               {"name": "b", "path": write_jsonl(tmp_path / "b.jsonl", b)}]
    cfg = curate_config(tmp_path, sources)
    m = run_curate(cfg)
    c = m["counts"]
    assert (c["dropped.exact_duplicate"], c["dropped.near_duplicate"], c["unique"]) == (2, 3, 5)
    assert m["sources"]["a"]["dropped.exact_duplicate"] == 1 and m["sources"]["b"]["dropped.near_duplicate"] == 2
    stats = json.loads((cfg.run_dir / "curate" / "stats.json").read_text())
    exact = {e["id"]: e["duplicate_of"] for e in stats["drops"]["exact_duplicate"]["examples"]}
    near = {e["id"]: e["duplicate_of"] for e in stats["drops"]["near_duplicate"]["examples"]}
    assert exact == {"a/2": "a/0", "b/0": "a/4"}
    assert near == {"a/3": "a/1", "b/1": "a/0", "b/4": "b/3"}

    cfg = curate_config(tmp_path, sources, near_dedup=False)
    c = run_curate(cfg, force=True)["counts"]
    assert (c["dropped.exact_duplicate"], c["dropped.near_duplicate"], c["unique"]) == (2, 0, 8)
    ids = [r for p in sorted((cfg.run_dir / "curate" / "shards").glob("*.parquet")) for r in pq.read_table(p).column("id").to_pylist()]
    assert sorted(ids) == ["a/0", "a/1", "a/3", "a/4", "b/1", "b/2", "b/3", "b/4"]
