"""The training process group's environment: rank and world size as `pipeline.stage_dir.rank_from_env` reads them,
local rank and rendezvous from torchrun's or SLURM's variables, one local process when nothing is set, and no
process group from a SLURM array."""

from __future__ import annotations

import pytest

from pipeline.errors import StageError
from train.distributed import first_slurm_host, resolve_dist_env


def test_slurm_task_variables_become_torch_rendezvous_variables():
    env = {"SLURM_PROCID": "13", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5", "SLURM_JOB_ID": "424242",
           "SLURM_JOB_NODELIST": "gpu-[007-008]"}
    d = resolve_dist_env(env)
    assert (d.rank, d.world_size, d.local_rank, d.source) == (13, 16, 5, "slurm")
    assert d.master_addr == "gpu-007"
    assert d.master_port == 20000 + 424242 % 20000  # the same on every task without talking
    assert resolve_dist_env({**env, "MASTER_ADDR": "head", "MASTER_PORT": "1234"}).master_addr == "head"


def test_torchrun_variables_win_over_slurm_and_nothing_means_one_local_process():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    d = resolve_dist_env(env)
    assert (d.rank, d.world_size, d.local_rank, d.master_addr, d.master_port, d.source) == (3, 8, 3, "10.0.0.1", 29500,
                                                                                           "torchrun")
    single = resolve_dist_env({})
    assert (single.rank, single.world_size, single.source, single.master_addr) == (0, 1, "single", "127.0.0.1")
    assert 0 < single.master_port < 65536


@pytest.mark.parametrize("nodelist,first", [("node01", "node01"), ("gpu[003-005,010],cpu1", "gpu003"),
                                            ("a[7],b[1-2]", "a7"), ("rack1-n[12-14]-ib", "rack1-n12-ib")])
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_a_slurm_array_task_is_refused_as_a_rank_of_the_process_group():
    env = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_COUNT": "4",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    with pytest.raises(StageError, match="SLURM array"):
        resolve_dist_env(env)
    assert resolve_dist_env({**env, "RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1234"}).source == "torchrun"


def test_a_barrier_of_one_process_never_reaches_the_backend(monkeypatch, tmp_path):
    """One rank has nothing to wait for: barrier() returns without a collective (with NCCL the first one builds a
    communicator); with more ranks it is torch's barrier."""
    import torch.distributed as dist

    from train.distributed import barrier

    created = not dist.is_initialized()  # an in-process training test earlier in the session may have left one
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        def refuse():
            raise AssertionError("a one-process barrier reached the backend")

        monkeypatch.setattr(dist, "barrier", refuse)
        barrier()
        monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
        with pytest.raises(AssertionError, match="reached the backend"):
            barrier()
    finally:
        monkeypatch.undo()
        if created:
            dist.destroy_process_group()
