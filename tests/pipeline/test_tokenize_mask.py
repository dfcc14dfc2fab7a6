"""tokenize: assistant-only loss masks found by prefix rendering, multi-turn conversations of templates that
re-render earlier turns split at those turns (every supervised token in the context the target generated it in)
or dropped, the 2*block_size filter, truncation, and fingerprint refusal of regen output from another
tokenizer/target."""

from __future__ import annotations

import json
import time

import pyarrow.parquet as pq
import pytest

from pipeline.regen.conversation import encode_chat
from pipeline.regen.stage import run_regen, write_conversations
from pipeline.errors import FingerprintMismatch
from pipeline.stage_dir import StageDir
from pipeline.target import build_byte_tokenizer, load_tokenizer, materialize_target, render_chat
from pipeline.tokenize import Dropped, assistant_loss_mask, assistant_samples, run_tokenize, shard_fingerprint
from tests.conftest import make_config

EOT = "<|im_end|>"

# Qwen3-like: the empty think block of thinking-off mode is written after the generation prompt and on the
# *last* assistant turn only, so a multi-turn history is re-rendered differently (not prefix-stable).
QWEN3_LIKE_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{%- if loop.last and enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
    "{%- endif %}{{ m.content + '<|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello, how can I help?"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def test_loss_mask_is_one_exactly_on_assistant_turns_and_their_end_of_turn_token():
    tok = build_byte_tokenizer()
    eot = tok.convert_tokens_to_ids(EOT)
    ids, mask = assistant_loss_mask(tok, CONVERSATION, enable_thinking=False, end_of_turn={eot})
    assert ids == encode_chat(tok, render_chat(tok, CONVERSATION, add_generation_prompt=False, enable_thinking=False))
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == f"Hello, how can I help?{EOT}4{EOT}"
    spans = [j for j in range(len(mask)) if mask[j] and (j == 0 or not mask[j - 1])]
    ends = [j for j in range(len(mask)) if mask[j] and (j + 1 == len(mask) or not mask[j + 1])]
    assert len(spans) == 2 and all(ids[j] == eot for j in ends)
    assert all(tok.decode([ids[j + 1]]) == "\n" and mask[j + 1] == 0 for j in ends)  # template glue unsupervised
    # the supervised span starts right after the generation prompt "<|im_start|>assistant\n"
    assert tok.decode(ids[: spans[0]]).endswith("<|im_start|>assistant\n")
    # a turn cut by max_new_tokens: the template closed it, not the target -> its <|im_end|> is unsupervised
    cut_ids, cut_mask = assistant_loss_mask(tok, CONVERSATION, enable_thinking=False, end_of_turn={eot},
                                            ended=[False, True])
    assert cut_ids == ids and tok.decode([t for t, m in zip(ids, cut_mask) if m]) == f"Hello, how can I help?4{EOT}"


def test_prompt_only_template_tokens_are_unsupervised_and_history_rewrites_are_refused():
    tok = build_byte_tokenizer()
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    eot = {tok.convert_tokens_to_ids(EOT)}
    single = CONVERSATION[:3]
    ids, mask = assistant_loss_mask(tok, single, enable_thinking=False, end_of_turn=eot)
    assert "<think>\n\n</think>\n\n" in tok.decode(ids)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == f"Hello, how can I help?{EOT}"  # think block: prompt
    with pytest.raises(Dropped) as e:
        assistant_loss_mask(tok, CONVERSATION, enable_thinking=False, end_of_turn=eot)
    assert e.value.reason == "template_not_prefix_stable" and e.value.detail.startswith("turn 1")


def _supervised_spans(mask: list[int]) -> list[tuple[int, int]]:
    starts = [j for j in range(len(mask)) if mask[j] and (j == 0 or not mask[j - 1])]
    return [(a, next((j for j in range(a, len(mask)) if not mask[j]), len(mask))) for a in starts]


THREE_TURNS = CONVERSATION + [{"role": "user", "content": "And 3+3?"},
                              {"role": "assistant", "content": "6, and 4+4 is 8"}]


def test_a_template_that_re_renders_history_splits_a_conversation_where_it_does():
    # Qwen3-like (thinking off): each assistant turn was generated after the generation prompt with its empty think
    # block but is re-rendered without it once a later turn follows: one sample per assistant turn, each with the
    # history exactly as the target saw it when it wrote that turn
    tok = build_byte_tokenizer()
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    eot = {tok.convert_tokens_to_ids(EOT)}
    samples = assistant_samples(tok, THREE_TURNS, enable_thinking=False, end_of_turn=eot)
    assert [s.first_turn for s in samples] == [0, 1, 2]
    assert [s.sample_id("c/1") for s in samples] == ["c/1", "c/1@t1", "c/1@t2"]
    turns = [i for i, m in enumerate(THREE_TURNS) if m["role"] == "assistant"]
    for s, i in zip(samples, turns):
        (a, b), = _supervised_spans(s.loss_mask)
        seen = encode_chat(tok, render_chat(tok, THREE_TURNS[:i], add_generation_prompt=True, enable_thinking=False))
        assert s.input_ids[:a] == seen  # the context is what the target was prompted with
        assert tok.decode(s.input_ids[a:b]) == THREE_TURNS[i]["content"] + EOT
        assert len(s.input_ids) == len(s.loss_mask) == b + 1  # closed by the template's newline, unsupervised
    assert "Hello, how can I help?<|im_end|>" in tok.decode(samples[2].input_ids)  # history kept, unsupervised
    assert tok.decode(samples[2].input_ids).count("<think>") == 1  # only the turn being written has it
    with pytest.raises(Dropped) as e:  # 'drop': the conversation as one sample cannot be rendered
        assistant_samples(tok, THREE_TURNS, enable_thinking=False, end_of_turn=eot, split=False)
    assert e.value.reason == "template_not_prefix_stable" and e.value.detail.startswith("turn 1")


def test_a_prefix_stable_template_keeps_a_conversation_in_one_sample():
    tok = build_byte_tokenizer()
    eot = {tok.convert_tokens_to_ids(EOT)}
    (sample,) = assistant_samples(tok, THREE_TURNS, enable_thinking=False, end_of_turn=eot)
    assert sample.first_turn == 0 and sample.sample_id("c/1") == "c/1"
    assert (sample.input_ids, sample.loss_mask) == assistant_loss_mask(tok, THREE_TURNS, enable_thinking=False,
                                                                       end_of_turn=eot)
    assert len(_supervised_spans(sample.loss_mask)) == 3


def test_a_template_without_end_of_turn_token_is_refused():
    tok = build_byte_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.role + ': ' + m.content + '\n' }}{% endfor %}" \
                        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    with pytest.raises(Dropped, match="no_end_of_turn_token"):
        assistant_loss_mask(tok, CONVERSATION[:3], enable_thinking=False, end_of_turn={tok.eos_token_id})


def _curate_and_regen_dataset_answers(cfg, answers: list[str]) -> None:
    """regen.backend=none over curate-format data whose answers have known lengths."""
    stage = StageDir(cfg.run_dir, "curate")
    rows = [{"id": f"t/{i}", "source": "t", "metadata": "{}",
             "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": a}]}
            for i, a in enumerate(answers)]
    write_conversations(stage.shards / "train-00000.parquet", rows)
    stage.write_manifest(config_hash="curated-for-tests", fingerprint={}, started=time.time())
    run_regen(cfg)
    run_tokenize(cfg)


def test_samples_under_min_loss_tokens_are_dropped_and_long_ones_truncated(tmp_path):
    # byte tokenizer: an answer of n characters is n + 1 supervised tokens (with <|im_end|>)
    cfg = make_config(tmp_path, overrides=["regen.backend=none", "tokenize.min_loss_tokens=16", "tokenize.max_len=64"])
    _curate_and_regen_dataset_answers(cfg, ["a" * 14, "b" * 15, "c" * 200])
    m = StageDir(cfg.run_dir, "tokenize").manifest()
    c = m["counts"]
    assert c["input"] == 3 and c["written"] == 2 and c["dropped.too_few_loss_tokens"] == 1
    assert c["truncated"] == 1 and m["drop_examples"][0]["id"] == "t/0"
    path = StageDir(cfg.run_dir, "tokenize").shard_path("00000", "parquet")
    table = pq.read_table(path)
    assert str(table.schema.field("input_ids").type) == "list<element: int32>"
    assert str(table.schema.field("loss_mask").type) == "list<element: uint8>"
    rows = {r["id"]: r for r in table.to_pylist()}
    assert rows["t/1"]["num_loss_tokens"] == 16 == sum(rows["t/1"]["loss_mask"])
    assert rows["t/2"]["num_tokens"] == 64 == len(rows["t/2"]["input_ids"])
    assert c["loss_tokens"] == sum(r["num_loss_tokens"] for r in rows.values())
    assert shard_fingerprint(path) == m["fingerprint"]
    assert set(m["fingerprint"]) == {"target", "tokenizer", "enable_thinking", "max_len"}


def _qwen3_like_tokenizer(cfg, tmp_path):
    location = materialize_target(cfg.target, cfg.cache_dir)
    tok = load_tokenizer(location, cfg.target)
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    path = tmp_path / "qwen3-like-template"
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("mode", ["split", "drop"])
def test_tokenize_stage_splits_or_drops_conversations_of_an_unstable_template_and_counts_them(tmp_path, mode):
    base = make_config(tmp_path)
    template = _qwen3_like_tokenizer(base, tmp_path)
    cfg = make_config(tmp_path, overrides=["regen.backend=none", f"target.tokenizer={template}",
                                           "tokenize.min_loss_tokens=8", f"tokenize.unstable_template={mode}"])
    long = "a long enough answer to be kept"
    rows = [{"id": "t/0", "source": "t", "metadata": "{}", "messages": [
                {"role": "user", "content": "q0"}, {"role": "assistant", "content": long},
                {"role": "user", "content": "q1"}, {"role": "assistant", "content": long + " too"},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "ok"}]},  # too short: dropped
            {"id": "t/1", "source": "t", "metadata": "{}",
             "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": long}]}]
    stage = StageDir(cfg.run_dir, "curate")
    write_conversations(stage.shards / "train-00000.parquet", rows)
    stage.write_manifest(config_hash="curated-for-tests", fingerprint={}, started=time.time())
    run_regen(cfg)
    run_tokenize(cfg)
    m = StageDir(cfg.run_dir, "tokenize").manifest()
    c = m["counts"]
    shard = StageDir(cfg.run_dir, "tokenize").shard_path("00000", "parquet")
    written = {r["id"]: r for r in pq.read_table(shard).to_pylist()}
    assert c["input"] == 2 and c["written"] + c["dropped"] == c["input"] + c["split"]
    if mode == "split":
        assert set(written) == {"t/0", "t/0@t1", "t/1"} and c["split"] == 2
        assert c["dropped.too_few_loss_tokens"] == 1 and m["drop_examples"][0]["id"] == "t/0@t2"
        assert written["t/0@t1"]["num_loss_tokens"] == len(long + " too") + 1
    else:
        assert set(written) == {"t/1"} and c["split"] == 0 and c["dropped.template_not_prefix_stable"] == 1
    assert c["loss_tokens"] == sum(r["num_loss_tokens"] for r in written.values())


def test_tokenize_refuses_regen_output_from_another_template_or_target(tmp_path):
    cfg = make_config(tmp_path, overrides=["regen.backend=none"])
    _curate_and_regen_dataset_answers(cfg, ["an answer long enough to be kept by the filter"])
    location = materialize_target(cfg.target, cfg.cache_dir)
    tok = load_tokenizer(location, cfg.target)
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    other = tmp_path / "other-template"
    tok.save_pretrained(other)

    changed = make_config(tmp_path, overrides=["regen.backend=none", f"target.tokenizer={other}"])
    with pytest.raises(FingerprintMismatch) as e:
        run_tokenize(changed, force=True)
    assert "tokenizer.chat_template_sha" in str(e.value) and "drafter regen" in str(e.value)

    reseeded = make_config(tmp_path, overrides=["regen.backend=none", "target.seed=1"])
    with pytest.raises(FingerprintMismatch, match="target.weights_sha"):
        run_tokenize(reseeded, force=True)
    assert json.loads((StageDir(cfg.run_dir, "tokenize").manifest_path).read_text())["counts"]["written"] == 1
