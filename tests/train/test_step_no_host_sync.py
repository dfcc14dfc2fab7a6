"""On CUDA the training step never waits for the device (torch engine, one rank): label rows, weights and FLOPs come
from the host copy of the blocks, the statistics stay on the device until read, the features arrive from pinned
memory -- so the host queues the next steps while the GPU runs. `torch.cuda.set_sync_debug_mode("error")` turns
any synchronising call inside the step into an error."""

from __future__ import annotations

import pytest
import torch

from tests.train.test_stage_train import _dist_env  # noqa: F401  (autouse: rendezvous vars + 1 thread)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-device synchronisation exists on CUDA only")
@pytest.mark.parametrize("kl", [0.0, 0.5])
def test_a_torch_engine_step_on_cuda_never_waits_for_the_device(kl):
    from pipeline.config import TrainConfig
    from train.data import collate
    from train.distributed import init_distributed
    from train.engine import TrainForward, build_engine
    from dflash_model.model import DFlashDrafter, DrafterArgs
    from train.step import train_step
    from train.trainer import features_fn

    _, device = init_distributed()
    D, V, B, MASK = 64, 128, 8, 120
    args = DrafterArgs(hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=V, block_size=B,
                       mask_token_id=MASK, target_layer_ids=[0, 1], num_target_layers=4)
    torch.manual_seed(0)
    drafter = DFlashDrafter(args)
    drafter.attach_target_head(torch.randn(V, D, device=device), torch.randn(V, D, device=device))
    g = torch.Generator().manual_seed(1)
    samples = [{"id": f"s/{i}", "input_ids": torch.randint(0, 100, (n,), generator=g),
                "loss_mask": torch.rand(n, generator=g) > 0.2, "features": torch.randn(n, 3 * D, generator=g)}
               for i, n in enumerate([90, 41, 77])]
    mbs = [collate(samples[:2], block_size=B, num_anchors=8, mask_token_id=MASK, seed=0, epoch=0, tile=128),
           collate(samples[2:], block_size=B, num_anchors=8, mask_token_id=MASK, seed=0, epoch=0, tile=128)]
    for mb in mbs:
        mb["features"], mb["batch"] = mb["features"].pin_memory(), mb["batch"].pin_memory()
    engine, _, _ = build_engine(TrainForward(drafter), TrainConfig(engine="torch", grad_accum=2, precision="bf16"),
                                total_steps=4, world_size=1, device=device)
    features_of = features_fn(None, [0, 1, 3], D, device, torch.bfloat16)
    final_norm = torch.nn.RMSNorm(D, device=device, dtype=torch.bfloat16) if kl else None

    def step():
        return train_step(engine, mbs, features_of, gamma=None, chunk_rows=64, attention="flex", world_size=1,
                          device=device, kl=kl, final_norm=final_norm)

    step()  # compiles flex attention and the loss chunk
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats, grad_norm = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(torch.as_tensor(stats.loss)) and float(grad_norm) > 0
