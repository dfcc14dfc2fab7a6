"""Synthetic chat data: random-word prompts (the `random_words` source kind) and conversations with known
defects (the curate benchmark and the resume tests).

`random_words(name, first, count)` gives prompts [first, first + count) of a `random_words` source: each a
function of (source name, index) only, 6-30 made-up words ending with '?', so any chunking reads the same text.

`write_synthetic(out_dir, n)` writes about n records into three sources of different layouts:

    chat.jsonl        50%  OpenAI messages, 1-3 user/assistant pairs, sometimes a system turn
    sharegpt.jsonl    25%  ShareGPT conversations (human/gpt)
    instruct.parquet  25%  Alpaca instruction/input/output, in row groups

and plants, at the given rates, exact duplicates (an earlier prompt side -- system + user turns --
verbatim, possibly from another source, with a fresh answer), near duplicates (the same with one word
changed: Jaccard of word 3-grams ~0.9-0.96 for 40-150 word prompts), malformed JSON lines (jsonl sources)
and conversations that cleaning must drop (empty turn, unknown role, control character). Returns the
source specs for `curate.sources` and the planted counts.
"""

from __future__ import annotations

import json
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ve", "da", "gu", "fe", "zo", "bi", "qua", "ter",
              "an", "el", "is", "or", "um", "ex", "in", "on"]


def _vocabulary(gen: np.random.Generator, size: int = 20000) -> np.ndarray:
    lengths = gen.integers(1, 4, size)
    parts = gen.integers(0, len(_SYLLABLES), (size, 3))
    words = {"".join(_SYLLABLES[p] for p in row[:k]) + str(i % 7 if i % 5 == 0 else "")
             for i, (row, k) in enumerate(zip(parts, lengths))}
    return np.array(sorted(words))


@lru_cache(maxsize=1)
def _word_list() -> np.ndarray:
    return _vocabulary(np.random.default_rng(0), 5000)


def random_words(name: str, first: int, count: int) -> list[str]:
    """Prompts [first, first + count) of the `random_words` source `name` (module docstring)."""
    vocab, tag = _word_list(), zlib.crc32(name.encode())
    out = []
    for i in range(first, first + count):
        gen = np.random.default_rng([tag, i])
        words = vocab[gen.integers(0, len(vocab), int(gen.integers(6, 31)))]
        out.append(" ".join(words.tolist()).capitalize() + "?")
    return out


class _Text:
    """Random sentences from a Zipf-like word distribution, drawn in big vectorized blocks."""

    def __init__(self, gen: np.random.Generator):
        self.gen = gen
        self.vocab = _vocabulary(gen)
        ranks = np.arange(1, len(self.vocab) + 1)
        p = 1.0 / ranks ** 0.9
        self.p = p / p.sum()
        self.buf = np.zeros(0, dtype=np.int64)

    def words(self, n: int) -> str:
        if len(self.buf) < n:
            self.buf = np.concatenate([self.buf, self.gen.choice(len(self.vocab), 1 << 20, p=self.p)])
        idx, self.buf = self.buf[:n], self.buf[n:]
        return " ".join(self.vocab[idx].tolist()).capitalize() + "."


def write_synthetic(out_dir: Path, n: int, *, seed: int = 0, exact_rate: float = 0.02, near_rate: float = 0.02,
                    malformed_rate: float = 0.001, defect_rate: float = 0.005) -> dict:
    """Write the three sources under `out_dir`; returns {"sources": [...], "planted": {...}}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = np.random.default_rng(seed)
    text = _Text(gen)
    sizes = {"chat": n // 2, "sharegpt": n // 4, "instruct": n - n // 2 - n // 4}
    planted = {"exact": 0, "near": 0, "malformed": 0, "defect": 0}
    earlier: list[tuple[str | None, list[str]]] = []  # prompt sides (system, user turns) to copy, bounded

    def prompt_side(single: bool) -> tuple[str | None, list[str]]:
        """A fresh prompt side, or a planted exact / near duplicate of an earlier one (whole prompt side:
        system + all user turns, which is what dedup compares). `single`: one user turn, no system."""
        u = gen.random()
        if earlier and u < exact_rate + near_rate:
            system, users = earlier[gen.integers(len(earlier))]
            if not single or (system is None and len(users) == 1):
                users = list(users)
                if u < exact_rate:
                    planted["exact"] += 1
                else:
                    planted["near"] += 1
                    j = int(gen.integers(len(users)))
                    words = users[j].split(" ")
                    words[gen.integers(len(words))] = text.vocab[gen.integers(len(text.vocab))]
                    users[j] = " ".join(words)
                return system, users
        turns = 1 if single else int(gen.choice([1, 1, 1, 2, 3]))
        system = "You are a helpful assistant." if not single and gen.random() < 0.2 else None
        side = (system, [text.words(int(gen.integers(40, 150))) for _ in range(turns)])
        if len(earlier) < 50000:
            earlier.append(side)
        else:
            earlier[gen.integers(len(earlier))] = side
        return side

    def answer() -> str:
        return text.words(int(gen.integers(20, 250)))

    def defect(messages: list[dict]) -> list[dict]:
        """Break one conversation in a way `clean` must catch."""
        planted["defect"] += 1
        kind = gen.integers(3)
        if kind == 0:
            messages[-1]["content"] = "   "
        elif kind == 1:
            messages[0]["role"] = "tool"
        else:
            messages[0]["content"] += "\x07"
        return messages

    def conversation() -> list[dict]:
        system, users = prompt_side(single=False)
        messages = [{"role": "system", "content": system}] if system else []
        for u in users:
            messages += [{"role": "user", "content": u}, {"role": "assistant", "content": answer()}]
        return defect(messages) if gen.random() < defect_rate else messages

    def write_jsonl(path: Path, count: int, to_record) -> None:
        with open(path, "w") as f:
            for _ in range(count):
                if gen.random() < malformed_rate:
                    planted["malformed"] += 1
                    f.write('{"messages": [{"role": "user", "content": "cut off\n')
                    continue
                f.write(json.dumps(to_record(conversation())) + "\n")

    write_jsonl(out_dir / "chat.jsonl", sizes["chat"], lambda m: {"messages": m})
    _from = {"user": "human", "assistant": "gpt", "system": "system"}
    write_jsonl(out_dir / "sharegpt.jsonl", sizes["sharegpt"],
                lambda m: {"conversations": [{"from": _from.get(t["role"], t["role"]), "value": t["content"]} for t in m]})

    rows = {"instruction": [], "input": [], "output": []}
    writer = None
    for i in range(sizes["instruct"]):
        rows["instruction"].append(prompt_side(single=True)[1][0])
        rows["input"].append("")
        rows["output"].append(answer())
        if len(rows["output"]) == 20000 or i == sizes["instruct"] - 1:
            table = pa.table(rows)
            writer = writer or pq.ParquetWriter(out_dir / "instruct.parquet", table.schema)
            writer.write_table(table)
            rows = {k: [] for k in rows}
    if writer:
        writer.close()
    sources = [
        {"name": "chat", "path": str(out_dir / "chat.jsonl"), "format": "openai", "weight": 0.5},
        {"name": "sharegpt", "path": str(out_dir / "sharegpt.jsonl"), "format": "sharegpt", "weight": 0.3},
        {"name": "instruct", "path": str(out_dir / "instruct.parquet"), "format": "alpaca", "weight": 0.2},
    ]
    return {"sources": sources, "planted": planted, "records": n}
