"""The top-p draw as one Triton kernel (pipeline/regen/generator_triton.py) picks what its torch reference
(`generator.nucleus_from_uniforms`) picks from the same uniforms, over the raw logits with the padded vocabulary left
out; run on the CPU through Triton's interpreter, on CUDA at the real vocabulary (GPU machine), and compiled for an
sm_90 GPU without one."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from tests.eval.test_triton_kernels import compile_for_sm90, run_interpreted  # noqa: E402


def _case(rows: int, vocab: int, padded: int, seed: int, dtype=torch.float32, device="cpu"):
    """Logits of three kinds of rows (peaked, flat, ties of equal logits), padded rows past `vocab`, uniforms."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab + padded, generator=gen) * 3
    logits[::3, 0] += 12  # peaked: a nucleus of one or two ids
    logits[1::3] *= 0.05  # flat: a nucleus of most of the vocabulary
    logits[2::3, : vocab // 2] = 1.25  # ties: half the vocabulary equally likely
    logits[:, vocab:] = 40.0  # padded ids: the most likely of all if they were not left out
    uniforms = torch.rand(rows, 10, generator=gen)
    return logits.to(dtype).to(device), uniforms.to(device)


def check_kernel_picks_what_the_reference_picks(device: str = "cpu"):
    from pipeline.regen.generator import nucleus_from_uniforms
    from pipeline.regen.generator_triton import nucleus_from_logits

    big = device != "cpu"
    for trial, (vocab, padded, top_p, temperature, dtype) in enumerate([
            (49_152 if big else 1_500, 64, 0.95, 0.7, torch.bfloat16),
            (151_936 if big else 1_100, 0, 0.9, 1.0, torch.float32),
            (1_000, 24, 0.5, 0.3, torch.float16)]):
        logits, uniforms = _case(96 if big else 24, vocab, padded, trial, dtype, device)
        got = nucleus_from_logits(logits, temperature, top_p, uniforms, vocab)
        probs = (logits[:, :vocab].double() / temperature).softmax(-1)
        want = nucleus_from_uniforms(probs, top_p, uniforms.double())
        assert got.dtype == torch.long and bool((got < vocab).all()), trial
        same = (got == want).float().mean().item()
        assert same >= 0.97, (trial, same, got[got != want].tolist(), want[got != want].tolist())


@pytest.mark.slow
def test_the_kernel_picks_what_the_reference_picks_in_the_interpreter():
    run_interpreted("check_kernel_picks_what_the_reference_picks", module="tests.pipeline.test_sampling_triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the GPU machine)")
def test_the_kernel_picks_what_the_reference_picks_on_cuda():
    check_kernel_picks_what_the_reference_picks("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the GPU machine)")
def test_sampled_draws_on_cuda_follow_the_nucleus_distribution():
    """sample_next on CUDA (the kernel) over a flat ~1,800-id nucleus: the draws by probability decile match
    `nucleus_probs`, as the torch path's do (tests/pipeline/test_regen_hf.py)."""
    from pipeline.regen.generator import Sampling, nucleus_probs, sample_next

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.linspace(0, 4, 8_000, device="cuda")[None]
    sampling = Sampling(temperature=1.0, top_p=0.9)
    n = 400_000
    draws = sample_next(logits.expand(n, -1).contiguous(), sampling, gen)
    probs = nucleus_probs(logits, sampling)[0]
    inside = probs > 0
    assert bool(inside[draws].all())
    order = torch.nonzero(inside).flatten()
    deciles = torch.tensor_split(order, 10)
    seen = torch.bincount(draws, minlength=probs.numel()).float() / n
    for part in deciles:
        assert abs(seen[part].sum().item() - probs[part].sum().item()) < 0.01


@pytest.mark.parametrize("dtype", ["*bf16", "*fp16", "*fp32"])
def test_the_kernel_compiles_for_an_sm90_gpu_without_one(dtype):
    from pipeline.regen.generator_triton import BLOCK_V, _nucleus_kernel

    signature = {"logits": dtype, "stride_b": "i32", "V": "i32", "uniforms": "*fp32", "stride_u": "i32",
                 "out": "*i64", "C": "i32", "scale": "fp32", "top_p": "fp32", "BLOCK": "constexpr", "CP": "constexpr"}
    compile_for_sm90(_nucleus_kernel, signature, {"BLOCK": BLOCK_V, "CP": 16})


def test_the_temperature_is_folded_into_the_kernels_base_two_scale():
    assert math.isclose(math.log2(math.e) / 0.7 * math.log(2), 1 / 0.7)
