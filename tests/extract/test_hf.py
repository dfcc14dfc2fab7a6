"""The hf backend's batching and its device->disk pipeline."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from extract.hf import HFExtractor, plan_batches
from extract.store import Shard, ShardWriter
from tests.extract.conftest import CACHE, extract_config


def test_batches_respect_the_padded_token_budget():
    lengths = [900, 500, 300, 300, 200, 100, 100, 100, 50, 10]
    batches = plan_batches(lengths, 600)
    assert batches[0] == (0, 1)  # longer than the budget: alone
    assert [i for a, b in batches for i in range(a, b)] == list(range(len(lengths)))
    for a, b in batches[1:]:
        assert (b - a) * lengths[a] <= 600
    with pytest.raises(ValueError, match="longest first"):
        plan_batches([1, 2], 10)


def test_a_long_sample_does_not_drag_short_ones_into_a_padded_batch():
    lengths = [4000] + [1000] * 10
    assert plan_batches(lengths, 65536) == [(0, 1), (1, 11)]  # greedy would pad 10 samples to 4000 (3x the work)
    assert plan_batches([100] * 50, 1000) == [(0, 10), (10, 20), (20, 30), (30, 40), (40, 50)]  # still fills the budget


def test_interleaved_shards_are_each_written_and_hashed_in_order(tmp_path, random_target):
    from pipeline.files import sha256_file

    _, model = random_target("qwen3")
    cfg = extract_config(tmp_path, "extract.tokens_per_batch=128", "extract.storage_dtype=fp8")
    ex = HFExtractor("x", cfg.target, cfg.extract, [1, 3, 5], model=model, device=torch.device("cpu"))
    rng = np.random.default_rng(0)
    work = []
    for k in range(3):
        ids = [rng.integers(3, 300, size=n).astype(np.int32) for n in sorted(rng.integers(1, 90, size=9), reverse=True)]
        w = ShardWriter(tmp_path / f"{k}.safetensors", [f"{k}/{i}" for i in range(len(ids))], ids,
                        [np.ones(len(x), np.uint8) for x in ids], num_taps=3, hidden_size=64, storage_dtype="fp8",
                        stream_hash=True)
        work.append((w, ids))
    ex.extract_units(work)
    for k, (w, ids) in enumerate(work):
        ex.wait(w)
        assert w.close() == sha256_file(tmp_path / f"{k}.safetensors")
        sh = Shard(tmp_path / f"{k}.safetensors")
        for i, x in enumerate(ids):
            ref = ex.features([x]).float()
            got = sh.sample(i, torch.float32)["features"]
            assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min() > 0.998
    ex.close()


def test_a_failed_write_surfaces_in_the_main_thread_without_hanging(tmp_path, random_target):
    _, model = random_target("qwen3")
    cfg = extract_config(tmp_path, "extract.tokens_per_batch=64", "extract.staging_buffers=1")
    ex = HFExtractor("x", cfg.target, cfg.extract, [1, 3], model=model, device=torch.device("cpu"))
    ids = [np.arange(3, 40, dtype=np.int32)] * 6
    w = ShardWriter(tmp_path / "x.safetensors", [str(i) for i in range(6)], ids, [np.ones(37, np.uint8)] * 6,
                    num_taps=2, hidden_size=64, storage_dtype="bfloat16")
    w.close()  # every write into it now fails
    with pytest.raises(RuntimeError, match="writing features failed"):
        ex.extract_unit(w, ids)
        ex.wait(w)
    ex.close()


def test_compile_auto_keeps_cpu_eager_and_a_hybrids_compiled_norms_and_mlps_are_checked_and_undone(random_target,
                                                                                                     monkeypatch):
    """extract.compile on a hybrid (which the layer loop does not rebuild) compiles its norms and MLPs instead, checked
    against eager on the probe batches: a compiled MLP that returns the wrong values is refused ("on": an error naming
    why the loop was not used; "auto" would run eager) and every module is eager again afterwards."""
    import extract.hf as hf
    from extract.hf import compiled_forward
    from extract.layers import forward_taps

    _, model = random_target("qwen3")
    assert compiled_forward(model, [1, 3], "auto", torch.device("cpu")) is forward_taps
    assert compiled_forward(model, [1, 3], "off", torch.device("cpu")) is forward_taps
    _, hybrid = random_target("qwen3_5_text")
    mlps = [layer.mlp for layer in hybrid.model.layers]

    def wrong_mlps(model):
        for m in mlps:
            m._compiled_call_impl = lambda *a, m=m, **k: torch.ones_like(type(m).forward(m, *a, **k))
        return mlps

    monkeypatch.setattr(hf, "compile_pointwise_modules", wrong_mlps)
    try:
        with pytest.raises(RuntimeError, match="linear_attention.*differ from eager"):
            compiled_forward(hybrid, [1, 3], "on", torch.device("cpu"))
        assert all(m._compiled_call_impl is None for m in mlps)
    finally:  # the fixture's model is shared
        for m in mlps:
            m._compiled_call_impl = None


def test_a_second_call_on_a_model_already_compiled_and_checked_is_not_checked_against_itself(random_target,
                                                                                            monkeypatch, caplog):
    """A process that runs the stage twice on one model (bench_hybrid: bf16, then fp8 features) finds it compiled by
    the first call: its eager reference would be the compiled forward itself (a relative error of 0 that checks
    nothing). The second call keeps the first call's check and says so; once the modules are eager again, a call
    checks anew."""
    import logging

    import extract.hf as hf
    from pipeline.target import uncompile

    _, hybrid = random_target("qwen3_5_text")
    mlps = [layer.mlp for layer in hybrid.model.layers]
    checks = []

    def slightly_off(model):  # a "compiled" MLP 1 % off eager: the first check measures it
        for m in mlps:
            m._compiled_call_impl = lambda *a, m=m, **k: type(m).forward(m, *a, **k) * (1 + 1e-2)
        return mlps

    monkeypatch.setattr(hf, "compile_pointwise_modules", slightly_off)
    monkeypatch.setattr(hf, "_max_relative_error", lambda *a, f=hf._max_relative_error: checks.append(1) or f(*a))
    try:
        with caplog.at_level(logging.INFO, logger="drafter.extract.hf"):
            for _ in range(2):
                hf.compiled_forward(hybrid, [1, 3], "on", torch.device("cpu"))
        first, second = [r.getMessage() for r in caplog.records if "extract.compile" in r.getMessage()]
        measured = float(first.rsplit("relative error ", 1)[1].rstrip(")"))
        assert 0 < measured < hf.COMPILED_MAX_ERROR and len(checks) == len(hf.COMPILE_PROBES)
        assert "already" in second and f"{measured:.2e}" in second and len(checks) == len(hf.COMPILE_PROBES)
        uncompile(mlps)
        hf.compiled_forward(hybrid, [1, 3], "on", torch.device("cpu"))  # eager again: checked again
        assert len(checks) == 2 * len(hf.COMPILE_PROBES)
    finally:  # the fixture's model is shared
        uncompile(mlps)


@pytest.mark.slow
def test_a_hybrids_extraction_runs_with_compiled_norms_and_mlps_equal_to_eager(random_target):
    """extract.compile=on on a Gated-DeltaNet hybrid: the model's forward with its norms and MLPs torch.compile'd
    (inductor, CPU here), each Gated-DeltaNet layer's gated output norm included, gives the eager features on shapes
    the probes did not have."""
    from extract.hf import compiled_forward
    from extract.layers import forward_taps
    from pipeline.target import uncompile

    _, hybrid = random_target("qwen3_5_text")
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(3, 300, (B, S), generator=gen) for B, S in [(3, 40), (1, 9)]]
    eager = [forward_taps(hybrid, ids, [1, 3]) for ids in batches]
    assert compiled_forward(hybrid, [1, 3], "on", torch.device("cpu")) is forward_taps
    compiled = [m for layer in hybrid.model.layers for m in (layer.mlp, layer.input_layernorm)]
    gated_norms = [layer.linear_attn.norm for layer in hybrid.model.layers if hasattr(layer, "linear_attn")]
    assert gated_norms and all(m._compiled_call_impl is not None for m in compiled + gated_norms)
    compiled += gated_norms
    for ids, ref in zip(batches, eager):
        torch.testing.assert_close(forward_taps(hybrid, ids, [1, 3]), ref, rtol=1e-4, atol=1e-4)
    uncompile(compiled)


def test_compile_check_refuses_a_layer_graph_that_drops_the_residual_or_scales_its_output(random_target, monkeypatch):
    """The probe check's bound (COMPILED_MAX_ERROR) is loose enough for bf16 rounding on real weights but not for a
    wrong graph: a layer step without its residual (relative error ~1) or 5 % off (~0.2) is refused."""
    import extract.hf as hf
    from extract.layers import call_decoder_layer

    _, model = random_target("qwen3")
    for wrong in (lambda layer, h, cos, sin: call_decoder_layer(layer, h, cos, sin) - h,
                  lambda layer, h, cos, sin: call_decoder_layer(layer, h, cos, sin) * 1.05):
        monkeypatch.setattr(hf, "compiled_layer_call", lambda: wrong)
        with pytest.raises(RuntimeError, match="compiled layers differ from eager"):
            hf.compiled_forward(model, [1, 3], "on", torch.device("cpu"))


@pytest.mark.slow
def test_compiled_layers_match_eager_with_one_graph_per_batch_rank_for_all_layers_and_shapes(random_target):
    """~60 s on 2 CPU cores (inductor C++ compile). All layers share one graph; B >= 2 and B == 1 get one each."""
    from torch._dynamo.utils import counters

    from extract.hf import compiled_forward
    from extract.layers import forward_taps

    _, model = random_target("qwen3")
    forward = compiled_forward(model, [1, 3, 5], "on", torch.device("cpu"))
    assert forward is not forward_taps
    graphs = counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(2)
    for B, S in [(3, 100), (1, 7), (5, 33), (2, 2)]:
        ids = torch.randint(3, 300, (B, S), generator=gen)
        torch.testing.assert_close(forward(model, ids, [1, 3, 5]), forward_taps(model, ids, [1, 3, 5]), rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs  # no recompile for new shapes (or per layer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's kernels run on CUDA (GPU machine with gpu-hybrid)")
def test_hybrid_extraction_on_fla_kernels_matches_the_unbatched_forward_and_the_torch_reference(monkeypatch):
    """A bf16 qwen3_5-style hybrid on CUDA with fla-core installed: the stage's padded batch (fla's chunked gated
    delta rule, its Triton short convolution) gives, per tapped layer, the features of `extract --verify`'s reference
    (an unbatched forward, also on fla) and of transformers' torch definitions of the rule and the convolution (fla
    unbound), at cosine >= verify_min_cosine."""
    import inspect

    from extract.layers import decoder_layers, forward_taps
    from extract.verify import layer_report
    from pipeline.config import ExtractConfig, TargetConfig
    from pipeline.target import gated_delta_kernels, load_target, materialize_target

    pytest.importorskip("fla")
    tcfg = TargetConfig(model="random:qwen3_5_text", device="cuda", dtype="bfloat16",
                        random_init={"linear_key_head_dim": 64, "linear_value_head_dim": 64})
    model = load_target(materialize_target(tcfg, CACHE), tcfg)
    assert gated_delta_kernels(model) == "fla"
    layers = [1, 3, 5, 7]
    ecfg = ExtractConfig()
    ex = HFExtractor("x", tcfg, ecfg, layers, model=model, device=torch.device("cuda"))
    rng = np.random.default_rng(0)
    batch = [rng.integers(3, 300, size=n).astype(np.int32) for n in (700, 333, 65, 9)]  # longest first, padded
    got = ex.features(batch)
    ex.close()

    def unbatched():
        return torch.cat([forward_taps(model, torch.from_numpy(x).long()[None].cuda(), layers)[0] for x in batch])

    checks = {"unbatched, fla": unbatched()}
    module = inspect.getmodule(type(decoder_layers(model)[0].linear_attn))
    assert getattr(module, "causal_conv1d_fn").original  # load_target bound fla's short convolution
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn"):
        monkeypatch.setattr(module, name, inspect.unwrap(getattr(module, name)))  # transformers' torch definition
    checks["unbatched, torch reference"] = unbatched()
    for what, ref in checks.items():
        for row in layer_report(got, ref, layers):
            assert row["finite"] and row["cos_mean"] >= ecfg.verify_min_cosine, (what, row)
