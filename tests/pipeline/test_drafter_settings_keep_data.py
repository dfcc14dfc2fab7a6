"""A drafter setting never invalidates the data stages: tokenize's and extract's config hashes hold no drafter field,
so after `drafter.block_size` (or the drafter's depth, or its attention layout) changes, tokenize and extract are
no-ops on their finished outputs (no refusal, no re-run, not a byte written), and the training rule they no longer
apply (two blocks of supervision) is applied where it belongs, by the training plan."""

from __future__ import annotations

from pathlib import Path

from extract.stage import run_extract
from extract.store import FeatureReader
from pipeline.regen.stage import run_regen
from pipeline.stage_dir import StageDir
from pipeline.tokenize import run_tokenize
from tests.conftest import make_config
from tests.pipeline.test_regen_stage import write_curated
from train.data import RunPlan

DATA = ["regen.backend=none", "regen.max_samples=null", "tokenize.max_len=128", "extract.shard_tokens=512"]
# byte tokenizer: an answer of n characters is n + 1 supervised tokens (its <|im_end|> included)
ANSWERS = ["a" * 5, "b" * 12, "c" * 20, "d" * 40, "e" * 60, "f" * 90]


def files_of(run_dir: Path) -> dict[str, int]:
    """Every file of the data stages with its mtime: a stage that re-ran or rewrote anything changes it."""
    return {str(p.relative_to(run_dir)): p.stat().st_mtime_ns for s in ("regen", "tokenize", "extract")
            for p in sorted((run_dir / s).rglob("*")) if p.is_file()}


def test_changing_a_drafter_setting_leaves_tokenize_and_extract_outputs_valid(tmp_path):
    cfg = make_config(tmp_path, overrides=[*DATA, "drafter.block_size=8"])
    write_curated(cfg.run_dir, [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": a}]
                                for i, a in enumerate(ANSWERS)])
    run_regen(cfg)
    tokenized, extracted = run_tokenize(cfg), run_extract(cfg)
    assert tokenized["counts"]["written"] == len(ANSWERS)  # short answers are data too: tokenize keeps them
    before = files_of(cfg.run_dir)

    for change in (["drafter.block_size=4"], ["drafter.block_size=16", "drafter.num_layers=1"],
                   ["drafter.layer_types=[sliding_attention, full_attention]", "drafter.sliding_window=32"]):
        changed = make_config(tmp_path, overrides=[*DATA, *change])
        assert run_tokenize(changed) == tokenized, change  # a no-op returning the finished manifest, not a refusal
        assert run_extract(changed) == extracted, change
        assert files_of(cfg.run_dir) == before, change
        assert StageDir(cfg.run_dir, "tokenize").manifest() == tokenized

    # the training rule: a sample needs two blocks of supervision, so the plan skips more of them as blocks grow
    reader = FeatureReader(cfg.run_dir / "extract")
    skipped = {}
    for block in (4, 8, 16):
        needed = make_config(tmp_path, overrides=[f"drafter.block_size={block}"]).min_loss_tokens
        plan = RunPlan.build(reader.ids, reader.lengths, reader.num_loss_tokens, block_size=block,
                             min_loss_tokens=needed,
                             budget=1024, world_size=1, grad_accum=1, seed=0, epochs=1, max_steps=None,
                             eval_fraction=0.0, eval_max_samples=None)
        skipped[block] = plan.too_few_loss_tokens
    assert skipped == {4: 1, 8: 2, 16: 3}  # 6, 13 and 21 supervised tokens against 8, 16 and 32
