"""The real target on CPU: SmolLM2-135M-Instruct regenerates a handful of real prompts (one MT-Bench
conversation answered turn by turn), and the loss mask of every tokenized sample decodes to exactly the
assistant text plus the <|im_end|> the model generated."""

from __future__ import annotations

import json
import time

import pyarrow.parquet as pq
import pytest

from pipeline.regen.stage import run_regen, write_conversations
from pipeline.stage_dir import StageDir
from pipeline.tokenize import run_tokenize
from tests.conftest import make_config, synthetic_records

pytestmark = pytest.mark.slow


def _prompts() -> list[list[dict]]:
    """Two word problems, an instruction with an input, and a two-turn chat (made up, in the public sets' layouts)."""
    gsm8k = [r["question"] for r in synthetic_records("gsm8k", 2)]
    code = synthetic_records("alpaca", 2)[1]
    mt = synthetic_records("mt_bench", 1)[0]["turns"]
    return ([[{"role": "user", "content": q}] for q in gsm8k]
            + [[{"role": "user", "content": code["instruction"] + "\n" + code.get("input", "")}]]
            + [[{"role": "user", "content": t} for t in mt]])


def test_smollm2_loss_mask_decodes_to_exactly_the_generated_assistant_text(tmp_path, smollm2_dir):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on the shared 2-core machine two OpenMP threads ran 5-7x slower than one
    cfg = make_config(tmp_path, base="configs/smollm2-135m.yaml", overrides=[
        "regen.max_new_tokens=32", "regen.max_samples=null", "regen.batch_size=4", "tokenize.min_loss_tokens=1"])
    curate = StageDir(cfg.run_dir, "curate")
    rows = [{"id": f"demo/{i}", "source": "demo", "messages": m, "metadata": "{}"}
            for i, m in enumerate(_prompts())]
    write_conversations(curate.shards / "train-00000.parquet", rows)
    curate.write_manifest(config_hash="curated-for-tests", fingerprint={}, started=time.time())
    try:
        run_regen(cfg)
        run_tokenize(cfg)
    finally:
        torch.set_num_threads(threads)

    regen = {r["id"]: r for r in pq.read_table(StageDir(cfg.run_dir, "regen").shard_path("00000", "parquet")).to_pylist()}
    tokenized = pq.read_table(StageDir(cfg.run_dir, "tokenize").shard_path("00000", "parquet")).to_pylist()
    assert len(tokenized) == len(rows) == len(regen)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    for sample in tokenized:
        conv = regen[sample["id"]]
        finish = json.loads(conv["metadata"])["regen"]["finish_reasons"]
        answers = [m["content"] for m in conv["messages"] if m["role"] == "assistant"]
        expected = "".join(a + ("<|im_end|>" if f == "stop" else "") for a, f in zip(answers, finish))
        supervised = [t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m]
        assert tok.decode(supervised) == expected, sample["id"]
        assert all(a.strip() for a in answers)  # the model answered every turn
    mt = regen["demo/3"]["messages"]
    assert [m["role"] for m in mt] == ["system", "user", "assistant", "user", "assistant"] or \
           [m["role"] for m in mt] == ["user", "assistant", "user", "assistant"]
