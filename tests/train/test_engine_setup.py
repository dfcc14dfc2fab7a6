"""The engines (DeepSpeed, and the torch engine for one process): the LR schedule, the DeepSpeed config, fp32
master weights under bf16, the torch engine stepping like DeepSpeed and resuming from its checkpoint, and the globally normalised loss under gradient accumulation (real DeepSpeed
engines on CPU, one process)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.config import TrainConfig
from tests.train.test_stage_train import _dist_env  # noqa: F401  (autouse: rendezvous vars + 1 thread)
from train.distributed import init_distributed
from train.engine import (TorchEngine, TrainForward, build_engine, cosine_with_warmup, current_lr, deepspeed_config,
                          warmup_steps)
from train.step import train_step


def test_lr_warms_up_linearly_then_decays_to_zero_on_a_cosine():
    total = 100
    f = cosine_with_warmup(total, 0.04)
    assert warmup_steps(total, 0.04) == 4
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0 and f(total) == 0.0
    assert f(4 + 48) == pytest.approx(0.5)  # half way through the decay
    decay = [f(s) for s in range(4, total + 1)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert cosine_with_warmup(10, 0.0)(0) == 1.0


def test_deepspeed_config_carries_zero_stage_clipping_accumulation_and_precision():
    cfg = deepspeed_config(TrainConfig(zero_stage=3, grad_accum=4, precision="bf16", grad_clip=1.0), world_size=8,
                           device=torch.device("cpu"))
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["gradient_clipping"] == 1.0
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["train_batch_size"] == 32
    assert cfg["bf16"]["enabled"] and cfg["data_types"]["grad_accum_dtype"] == "fp32"
    assert not deepspeed_config(TrainConfig(precision="fp32", zero_stage=0), world_size=1,
                                device=torch.device("cpu"))["bf16"]["enabled"]


# ----------------------------------------------------------------------------------------------
# Real engines
# ----------------------------------------------------------------------------------------------

D, V, B, MASK = 32, 64, 8, 60


def _drafter(seed: int = 0):
    from dflash_model.model import DFlashDrafter, DrafterArgs

    args = DrafterArgs(hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=V, block_size=B,
                       mask_token_id=MASK, target_layer_ids=[0, 1], num_target_layers=4)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(args)
    g = torch.Generator().manual_seed(99)
    drafter.attach_target_head(torch.randn(V, D, generator=g), torch.randn(V, D, generator=g))
    return drafter


def _micro_batches():
    """Two micro-batches of very different size, and the same three samples packed into one."""
    from train.data import collate

    g = torch.Generator().manual_seed(5)
    samples = []
    for i, n in enumerate([40, 17, 30]):
        samples.append({"id": f"x/{i}", "input_ids": torch.randint(0, 50, (n,), generator=g),
                        "loss_mask": torch.rand(n, generator=g) > 0.2, "features": torch.randn(n, 2 * D, generator=g)})
    kw = dict(block_size=B, num_anchors=6, mask_token_id=MASK, seed=0, epoch=0)
    return [collate(samples[:1], **kw), collate(samples[1:], **kw)], [collate(samples, **kw)]


def _features_of(mb):
    return mb["features"], mb["batch"]


def _reference_grad_norm(micro_batches) -> float:
    """Plain PyTorch: gradient of sum(w * CE) / sum(w) over all micro-batches."""
    from train.loss import dflash_loss, label_weights

    drafter = _drafter()
    total_w = sum(float(label_weights(mb["batch"]).sum()) for mb in micro_batches)
    for mb in micro_batches:
        hidden = drafter.forward_train(mb["features"], mb["batch"], "dense")
        loss, _ = dflash_loss(hidden, drafter.lm_head_weight, mb["batch"], normalizer=total_w)
        loss.backward()
    return float(torch.stack([p.grad.norm() for p in drafter.parameters()]).norm())


def deepspeed(zero_stage: int):
    """A DeepSpeed engine case: the slow tier (`make test`); the torch engine's case runs in `make test-fast` too."""
    return pytest.param("deepspeed", zero_stage, marks=pytest.mark.slow)


@pytest.mark.parametrize("engine_kind,zero_stage", [deepspeed(0), deepspeed(2), ("torch", 0)])
def test_accumulated_micro_batches_give_the_gradient_of_one_globally_normalised_batch(engine_kind, zero_stage):
    init_distributed()
    two, one = _micro_batches()
    expected = _reference_grad_norm(two)
    weights = {}
    for name, mbs in (("accumulated", two), ("packed", one)):
        train_cfg = TrainConfig(zero_stage=zero_stage, precision="fp32", grad_accum=len(mbs), grad_clip=1e9, lr=1e-2,
                                engine=engine_kind)
        engine, _, _ = build_engine(TrainForward(_drafter()), train_cfg, total_steps=10, world_size=1,
                                    device=torch.device("cpu"))
        stats, grad_norm = train_step(engine, mbs, _features_of, gamma=None, chunk_rows=16, attention="dense",
                                      world_size=1, device=torch.device("cpu"))
        assert float(grad_norm) == pytest.approx(expected, rel=1e-4), name
        assert engine.global_steps == 1
        weights[name] = {k: v.clone() for k, v in engine.module.state_dict().items()}
        weights[name + "_loss"] = stats.loss
    assert weights["accumulated_loss"] == pytest.approx(weights["packed_loss"], rel=1e-5)
    for k in weights["packed"]:
        torch.testing.assert_close(weights["accumulated"][k], weights["packed"][k], rtol=1e-4, atol=1e-6)


def _stepped_optimizer(engine) -> torch.optim.Optimizer:
    """The torch AdamW an engine steps (DeepSpeed wraps it as `basic_optimizer`)."""
    return engine.optimizer if isinstance(engine, TorchEngine) else engine.basic_optimizer


@pytest.mark.parametrize("engine_kind,zero_stage", [deepspeed(0), deepspeed(1), deepspeed(2), deepspeed(3), ("torch", 0)])
def test_bf16_training_keeps_fp32_master_weights_and_optimizer_state(engine_kind, zero_stage):
    init_distributed()
    _, one = _micro_batches()
    train_cfg = TrainConfig(zero_stage=zero_stage, precision="bf16", grad_accum=1, engine=engine_kind)
    engine, _, _ = build_engine(TrainForward(_drafter()), train_cfg, total_steps=10, world_size=1,
                                device=torch.device("cpu"))
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    assert engine.module.drafter.lm_head_weight.dtype == torch.bfloat16

    def features_of(mb):
        return mb["features"].to(torch.bfloat16), mb["batch"]

    stats, grad_norm = train_step(engine, one, features_of, gamma=None, chunk_rows=16, attention="dense",
                                  world_size=1, device=torch.device("cpu"))
    assert math.isfinite(stats.loss) and math.isfinite(float(grad_norm))
    # what the torch AdamW actually stepped: fp32 master copies (DeepSpeed: flat partitions), with fp32 moments
    stepped = [(p, s) for p, s in _stepped_optimizer(engine).state.items() if "exp_avg" in s]
    assert stepped and all(p.dtype == torch.float32 and s["exp_avg"].dtype == torch.float32 for p, s in stepped)
    assert sum(p.numel() for p, _ in stepped) == sum(p.numel() for p in engine.module.parameters())


def _run_steps(engine, steps: list[list[dict]], features_of=_features_of) -> list[tuple[float, float, float]]:
    """(loss, grad norm, lr) of each optimizer step over `steps` (lists of micro-batches)."""
    out = []
    for mbs in steps:
        lr = current_lr(engine)
        stats, grad_norm = train_step(engine, mbs, features_of, gamma=None, chunk_rows=16, attention="dense",
                                      world_size=1, device=torch.device("cpu"))
        out.append((stats.loss, float(grad_norm), lr))
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.slow
def test_torch_engine_takes_the_steps_of_the_deepspeed_engine(precision):
    """Same drafter, data, clipping (active: a small max norm), accumulation and schedule: the same losses, grad
    norms, learning rates and weights after three optimizer steps (bf16: within bf16 rounding)."""
    init_distributed()
    two, _ = _micro_batches()
    cast = (lambda mb: (mb["features"].to(torch.bfloat16), mb["batch"])) if precision == "bf16" else _features_of
    runs = {}
    for kind in ("deepspeed", "torch"):
        train_cfg = TrainConfig(zero_stage=2, precision=precision, grad_accum=2, grad_clip=0.5, lr=1e-2, engine=kind,
                                warmup_ratio=0.5)
        engine, _, _ = build_engine(TrainForward(_drafter()), train_cfg, total_steps=3, world_size=1,
                                    device=torch.device("cpu"))
        curve = _run_steps(engine, [two] * 3, cast)
        runs[kind] = (curve, {k: v.float().clone() for k, v in engine.module.state_dict().items()})
    tol = dict(rel=1e-5) if precision == "fp32" else dict(rel=2e-2)
    for (ds_loss, ds_norm, ds_lr), (t_loss, t_norm, t_lr) in zip(runs["deepspeed"][0], runs["torch"][0]):
        assert t_lr == ds_lr and t_loss == pytest.approx(ds_loss, **tol) and t_norm == pytest.approx(ds_norm, **tol)
    assert runs["torch"][0][0][1] > 0.5, "clipping must be active for the comparison to cover it"
    atol = 1e-6 if precision == "fp32" else 2e-2
    for k, v in runs["deepspeed"][1].items():
        torch.testing.assert_close(runs["torch"][1][k], v, rtol=0, atol=atol)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_torch_engine_resumed_from_its_checkpoint_continues_bit_identically(tmp_path, precision):
    init_distributed()
    two, _ = _micro_batches()
    cast = (lambda mb: (mb["features"].to(torch.bfloat16), mb["batch"])) if precision == "bf16" else _features_of
    train_cfg = TrainConfig(precision=precision, grad_accum=2, lr=1e-2, engine="torch")

    def engine():
        return build_engine(TrainForward(_drafter()), train_cfg, total_steps=4, world_size=1,
                            device=torch.device("cpu"))[0]

    straight = engine()
    reference = _run_steps(straight, [two] * 4, cast)
    first = engine()
    _run_steps(first, [two] * 2, cast)
    first.save_checkpoint(str(tmp_path), tag="step-2")
    resumed = engine()
    assert resumed.load_checkpoint(str(tmp_path), tag="step-2")[0] == str(tmp_path / "step-2")
    assert resumed.global_steps == 2
    assert _run_steps(resumed, [two] * 2, cast) == reference[2:]
    for k, v in straight.module.state_dict().items():
        assert torch.equal(resumed.module.state_dict()[k], v), k
    assert not any(f.suffix in (".pt", ".bin", ".pkl") for f in (tmp_path / "step-2").iterdir()), "no pickle files"


def test_training_benchmark_runs_the_trainer_and_bare_steps_at_the_tiny_shape():
    import importlib.util
    import sys

    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location("bench_train", REPO / "benchmarks" / "bench_train.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_train"] = bench  # dataclasses look their module up
    spec.loader.exec_module(bench)
    results = [bench.run_variant(v, bench.SHAPES["tiny"], 2, torch.device("cpu"), steps=1, warmup=0, zero_stage=2,
                                 peak=None) for v in ("trainer-dense", "bare-dense-row2", "trainer-dense-online-kl-anc4")]
    for r in results:
        assert r.ok and r.tokens_per_s > 0 and r.ms_per_seq > 0 and r.tflops_per_s > 0 and math.isfinite(r.loss)
    assert results[0].loss == pytest.approx(results[1].loss, rel=1e-6)  # same init and data: accumulated == packed
    for name in bench.SMOLLM2:  # the H200 table's variants are all well-formed
        bench.Variant.parse(name)


def test_training_benchmark_times_online_training_against_a_resident_hybrid_target_and_splits_the_step():
    """bench_train's tiny-hybrid shape (the Qwen3.6-27B run's layout at toy size): the drafter is [S,S,S,S,F], the
    online target is a Gated-DeltaNet hybrid, and the result splits the step into the target's forward and the
    drafter's share (adding up to the step) and counts the target's forward FLOPs in a second MFU."""
    import importlib.util
    import sys

    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location("bench_train", REPO / "benchmarks" / "bench_train.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_train"] = bench
    spec.loader.exec_module(bench)
    shape = bench.SHAPES["tiny-hybrid"]
    args = bench.make_args(shape)
    assert args.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and args.sliding_window == 64
    target = bench.make_target(shape, torch.device("cpu"), torch.float32)
    assert "linear_attention" in target.config.layer_types  # the hybrid, not the Llama stand-in

    r = bench.run_variant("trainer-dense-online-row2", shape, 2, torch.device("cpu"), steps=1, warmup=0,
                          zero_stage=2, peak=1e12, engine="torch")
    assert r.ok and r.tokens_per_s > 0 and math.isfinite(r.loss)
    assert r.target_forward_ms > 0
    assert r.target_forward_ms + r.drafter_step_ms == pytest.approx(r.ms_per_seq * r.seqs)
    from benchmarks.bench_extract import flops_per_token
    from extract.layers import stored_tap_ids

    taps = stored_tap_ids(args.target_layer_ids, shape["target_layers"], False)
    S = shape["seq_len"]
    assert r.target_flops == pytest.approx(2 * S * flops_per_token(target, taps, S / 2, upto=max(taps)))
    assert r.mfu_with_target == pytest.approx(r.mfu * (1 + r.target_flops / (r.tflops_per_s * 1e12 * r.ms_per_seq
                                                                               * r.seqs / 1e3)))
    offline = bench.run_variant("trainer-dense", shape, 2, torch.device("cpu"), steps=1, warmup=0, zero_stage=2,
                                peak=1e12, engine="torch")
    assert offline.target_forward_ms is None and offline.mfu_with_target is None
    for name in bench.QWEN36_27B:  # the H200 set is well-formed and online
        assert bench.Variant.parse(name).online


def test_compiling_the_layers_logs_every_recompilation_unless_torch_logs_chose_the_logs(monkeypatch):
    """compile_layers turns on torch's `recompiles` log (each recompilation with the guard that failed, in the stage
    log: what names the cause of a slow window's compile_s), and leaves a user's TORCH_LOGS choice alone."""
    from torch._logging._internal import log_state

    from dflash_model.model import DFlashDrafter, DrafterArgs
    from train.engine import compile_layers

    args = DrafterArgs(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       intermediate_size=32, rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=40, block_size=4,
                       mask_token_id=30, target_layer_ids=[1], num_target_layers=2)
    try:
        torch._logging.set_logs()
        monkeypatch.setenv("TORCH_LOGS", "graph_breaks")
        compile_layers(DFlashDrafter(args))
        assert not log_state.is_artifact_enabled("recompiles")
        monkeypatch.delenv("TORCH_LOGS")
        compile_layers(DFlashDrafter(args))
        assert log_state.is_artifact_enabled("recompiles")
    finally:
        torch._logging.set_logs()
