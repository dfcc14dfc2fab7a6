"""Config validation: every meaningless value is refused at load time (and so by `drafter plan` and every stage)
with one line that names the key and what is allowed; moved keys name their new place; fields declared
`hashed=False` stay out of a stage's config hash; what exists only after a stage has run is a stage error."""

from __future__ import annotations

import json

import pytest

from drafter.cli import main as drafter_main
from pipeline.config import ConfigError, describe_fields, hashed_fields, load_config, section_hash
from pipeline.errors import StageError
from tests.conftest import REPO, synthetic_records, write_records

TINY = REPO / "configs/tiny.yaml"
MT_BENCH = "own/mt_bench.jsonl"  # a path string: these configs are only loaded (nothing reads the file)


@pytest.mark.parametrize("override, message", [
    ("train.num_anchors=0", "train.num_anchors: must be >= 1, got 0"),
    ("train.max_steps=-5", "train.max_steps: must be >= 1, got -5"),
    ("train.micro_batch_tokens=0", "train.micro_batch_tokens: must be >= 1, got 0"),
    ("train.lr=-1", "train.lr: must be > 0, got -1.0"),
    ("train.log_every=0", "train.log_every: must be >= 1, got 0"),
    ("train.eval_fraction=1", "train.eval_fraction: must be in [0, 1), got 1.0"),
    ("train.warmup_ratio=1.5", "train.warmup_ratio: must be in [0, 1], got 1.5"),
    ("train.grad_accum=0", "train.grad_accum: must be >= 1, got 0"),
    ("train.epochs=0", "train.epochs: must be > 0, got 0.0"),
    ("tokenize.max_len=4", "tokenize.max_len: must be >= 16, got 4"),
    ("curate.min_chars=-1", "curate.min_chars: must be >= 1, got -1"),
    ("curate.total=0", "curate.total: must be >= 1, got 0"),
    ("curate.eval_size=-1", "curate.eval_size: must be >= 0, got -1"),
    (f"curate.sources=[{{name: a, path: {MT_BENCH}, max_samples: 0}}]",
     "curate.sources[0].max_samples: must be >= 1, got 0"),
    (f"curate.sources=[{{name: a, path: {MT_BENCH}, weight: 0}}]",
     "curate.sources: every weight is 0; at least one source needs weight > 0"),
    (f"curate.sources=[{{name: a, path: {MT_BENCH}, weight: -1}}]", "curate.sources[0].weight: must be >= 0, got -1.0"),
    ("curate.max_chars=0", "curate.max_chars: must be >= 1, got 0"),
    ("regen.max_new_tokens=0", "regen.max_new_tokens: must be >= 1, got 0"),
    ("regen.temperature=-0.5", "regen.temperature: must be >= 0, got -0.5"),
    ("regen.top_p=0", "regen.top_p: must be in (0, 1], got 0.0"),
    ("regen.vllm.gpu_memory_utilization=1.5", "regen.vllm.gpu_memory_utilization: must be in (0, 1], got 1.5"),
    ("extract.num_taps=0", "extract.num_taps: must be >= 1, got 0"),
    ("extract.layer_ids=[2,-1]", "extract.layer_ids[1]: must be >= 0, got -1"),
    ("extract.layer_ids=[3,3]", "extract.layer_ids: [3, 3] repeats a layer"),
    ("extract.shard_tokens=0", "extract.shard_tokens: must be >= 1, got 0"),
    ("drafter.num_layers=0", "drafter.num_layers: must be >= 1, got 0"),
    ("drafter.num_attention_heads=6", "drafter.num_attention_heads: 6 is not a multiple of drafter.num_key_value_heads"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens: must be >= 1, got 0"),
    ("eval.warmup_tokens=-1", "eval.warmup_tokens: must be >= 0, got -1"),
    ("eval.benchmarks=[{name: gsm8k, num_samples: 0, path: x.jsonl}]",
     "eval.benchmarks[0].num_samples: must be >= 1, got 0"),
    ("curate.sources=[{name: a}]",
     "curate.sources[0]: name the dataset by exactly one public identity (hub, url or origin), or give your own file"),
    ("curate.sources=[{name: a, hub: org/set, url: 'https://x.org/a.jsonl'}]",
     "curate.sources[0]: name the dataset by exactly one public identity (hub, url or origin)"),
    ("curate.sources=[{name: a, path: own.jsonl, hub: org/set}]",
     "curate.sources[0].path: your own file is read as it is; curate.sources[0].hub belongs to a public dataset"),
    ("curate.sources=[{name: a, url: 'https://x.org/a.jsonl', subset: main}]",
     "curate.sources[0].subset: only for a hub dataset (curate.sources[0].hub)"),
    ("curate.sources=[{name: a, hub: 'not a hub id'}]", "curate.sources[0].hub: 'not a hub id' is not a hub dataset id"),
    ("curate.sources=[{name: a, url: 'ftp://x.org/a.jsonl'}]", "curate.sources[0].url: 'ftp://x.org/a.jsonl' is not an"),
    ("curate.sources=[{name: a, hub: org/set, sha256: abc}]", "curate.sources[0].sha256: expected 64 lower-case hex"),
    ("curate.sources=[{name: a, hub: org/set, file: ../up.jsonl}]",
     "curate.sources[0].file: '../up.jsonl' must be a name inside the mirror directory"),
    ("curate.sources=[{name: a, hub: org/set, use: maybe}]", "curate.sources[0].use: 'maybe' is not one of"),
    ("curate.sources=[{name: a, random_words: 5, hub: org/set}]",
     "curate.sources[0].random_words: a generated entry reads no dataset; remove curate.sources[0].hub"),
    ("curate.sources=[{name: a, random_words: 5, synthesize: {count: 3}}]",
     "curate.sources[0]: curate.sources[0].synthesize and curate.sources[0].random_words exclude each other"),
    ("curate.sources=[{name: a, synthesize: {count: 10, max_attempts: 5}}]",
     "curate.sources[0].synthesize.max_attempts: must be >= curate.sources[0].synthesize.count (10), got 5"),
    ("curate.sources=[{name: a, synthesize: {min_letter_share: 2}}]",
     "curate.sources[0].synthesize.min_letter_share: must be in [0, 1], got 2.0"),
    ("eval.benchmarks=[{name: held_out, path: x.jsonl}]",
     "eval.benchmarks[0].name: a generated entry reads no dataset; remove eval.benchmarks[0].path"),
    ("eval.benchmarks=[{name: gsm8k}]", "eval.benchmarks[0]: name the dataset by exactly one public identity"),
])
def test_a_meaningless_value_is_one_line_naming_the_key_and_the_allowed_range(override, message):
    extra = ["drafter.num_key_value_heads=4"] if override.startswith("drafter.num_attention_heads") else []
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override, *extra])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_max_len_must_leave_room_for_the_supervised_tokens_a_sample_needs():
    # tiny: drafter.block_size 8 -> a sample needs 16 supervised tokens (2 blocks)
    with pytest.raises(ConfigError, match=r"^tokenize.max_len: must be > 16 .*got 16$"):
        load_config(TINY, ["tokenize.max_len=16"])
    with pytest.raises(ConfigError, match=r"^tokenize.max_len: must be > 40 .*got 40$"):
        load_config(TINY, ["tokenize.max_len=40", "tokenize.min_loss_tokens=40"])
    assert load_config(TINY, ["tokenize.max_len=17"]).tokenize.max_len == 17


@pytest.mark.parametrize("old, new", [
    ("regen.max_len=512", "tokenize.max_len"),
    ("regen.min_loss_tokens=4", "tokenize.min_loss_tokens"),
    ("regen.tensor_parallel_size=2", "regen.vllm.tensor_parallel_size"),
    ("regen.gpu_memory_utilization=0.5", "regen.vllm.gpu_memory_utilization"),
    ("extract.enforce_eager=true", "extract.vllm.enforce_eager"),
])
def test_a_moved_key_names_its_new_place(old, new):
    with pytest.raises(ConfigError, match=rf"^config key '{old.split('=')[0]}' moved to '{new}'$"):
        load_config(TINY, [old])


def test_drafter_plan_refuses_what_the_stages_refuse_with_one_line(capsys):
    assert drafter_main(["plan", "--config", str(REPO / "configs/qwen3-8b.yaml"), "train.num_anchors=0"]) == 2
    err = capsys.readouterr().err
    assert err == "drafter plan: error: train.num_anchors: must be >= 1, got 0\n"


def test_a_target_that_does_not_exist_is_one_line_not_a_transformers_traceback(capsys, tmp_path):
    argv = ["plan", "--config", str(TINY), f"runs_dir={tmp_path}", "target.model=/nonexistent"]
    assert drafter_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("drafter plan: error: target.model: '/nonexistent' is not a model directory")
    assert err.count("\n") == 1
    not_a_model = tmp_path / "empty-dir"
    not_a_model.mkdir()
    assert drafter_main(["plan", "--config", str(TINY), f"runs_dir={tmp_path}", f"target.model={not_a_model}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"drafter plan: error: target.model: cannot open '{not_a_model}'") and err.count("\n") == 1


def test_eval_size_above_what_survives_dedup_is_a_stage_error_naming_the_key(tmp_path):
    from pipeline.curate.stage import run_curate

    mt = write_records(tmp_path / "mt.jsonl", synthetic_records("mt_bench", 80))
    cfg = load_config(TINY, [f"runs_dir={tmp_path}", f"curate.sources=[{{name: mt, path: {mt}}}]",
                             "curate.total=null", "curate.eval_size=1000"])
    with pytest.raises(StageError, match=r"^curate.eval_size=1,000 but only \d+ unique conversations survived"):
        run_curate(cfg)


def test_fields_declared_unhashed_stay_out_of_the_hash_and_the_rest_are_in():
    base = load_config(TINY)
    scheduling = load_config(TINY, ["train.log_every=1", "train.save_every=3", "train.num_workers=4",
                                    "train.wandb.mode=disabled", "train.eval_max_samples=7", "curate.num_workers=3"])
    assert section_hash(hashed_fields(base.train)) == section_hash(hashed_fields(scheduling.train))
    assert section_hash(hashed_fields(base.curate)) == section_hash(hashed_fields(scheduling.curate))
    assert "wandb" not in hashed_fields(base.train) and "log_every" not in hashed_fields(base.train)
    for changed in (["train.lr=1e-5"], ["train.num_anchors=3"], ["train.seed=1"]):
        assert section_hash(hashed_fields(load_config(TINY, changed).train)) != section_hash(hashed_fields(base.train))
    sources = hashed_fields(base.curate)["sources"]  # nested sections become plain values
    assert json.loads(json.dumps(sources))[0]["name"] == "words"


def test_the_config_reference_states_each_range():
    rows = {key: text for key, _, text in describe_fields()}
    assert rows["train.lr"].endswith("(> 0)")
    assert rows["regen.top_p"].endswith("(in (0, 1])")
    assert rows["curate.eval_size"].endswith("(>= 0)")
