"""The stage-runner contract: atomic writes, manifests, idempotence, fingerprint refusal, rank slicing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from pipeline.errors import FingerprintMismatch, StageBusy, StageError
from pipeline.files import AtomicFile, Journal, atomic_write_json, read_json
from pipeline.stage_dir import RankInfo, StageDir, check_fingerprint, rank_from_env, units_for_rank
from tests.conftest import REPO


def test_atomic_write_never_leaves_a_partial_file_when_the_writer_is_killed(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    code = (
        "import sys, time\n"
        "from pipeline.files import AtomicFile\n"
        f"with AtomicFile(r'{target}') as tmp:\n"
        "    f = open(tmp, 'wb'); f.write(b'x' * 1000); f.flush()\n"
        "    print('writing', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"writing"
    proc.kill()
    proc.wait()
    assert target.read_bytes() == b"old"  # the reader sees the old file, never a part of the new one
    leftovers = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert leftovers  # debris exists ...
    StageDir(tmp_path.parent, tmp_path.name).begin("h")  # ... and begin() removes it
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_journal_keeps_every_appended_item_across_kill_9_and_cuts_a_torn_last_line(tmp_path):
    path = tmp_path / "work" / "unit.jsonl"
    code = (
        "import time\n"
        "from pipeline.files import Journal\n"
        f"j = Journal(r'{path}')\n"
        "for i in range(3):\n"
        "    j.append({'key': i, 'payload': 'x' * 100})\n"
        "with open(j.path, 'ab') as f:\n"  # what a kill in the middle of the fourth write leaves
        "    f.write(b'{\"key\": 3, \"pay'); f.flush()\n"
        "print('written', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=REPO)
    assert proc.stdout.readline().strip() == b"written"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    journal = Journal(path)
    assert [item["key"] for item in journal.items] == [0, 1, 2]
    assert path.read_bytes().endswith(b"}\n")  # the torn line is gone from the file too
    journal.append({"key": 3})
    assert [item["key"] for item in Journal(path).items] == [0, 1, 2, 3]
    journal.remove()
    assert not path.exists() and Journal(path).items == []


def test_atomic_file_discards_the_temp_on_error(tmp_path):
    target = tmp_path / "a.txt"
    with pytest.raises(RuntimeError):
        with AtomicFile(target) as tmp:
            tmp.write_text("partial")
            raise RuntimeError("boom")
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def _finish_one(stage: StageDir, unit: str, payload: bytes):
    path = stage.shard_path(unit, "bin")
    with AtomicFile(path) as tmp:
        tmp.write_bytes(payload)
    return stage.finish_unit(unit, [path], rows=len(payload))


def test_complete_stage_is_a_noop_with_the_same_config_and_refused_with_another(tmp_path):
    stage = StageDir(tmp_path, "curate")
    assert stage.begin("hash-a") is True
    _finish_one(stage, "u0", b"abc")
    stage.write_manifest(config_hash="hash-a", fingerprint={"k": 1}, counts={"rows": 3}, started=time.time())
    assert stage.begin("hash-a") is False
    with pytest.raises(StageError, match="made with another config"):
        stage.begin("hash-b")
    assert stage.begin("hash-b", force=True) is True
    assert not stage.is_complete()


def test_a_config_change_is_refused_with_the_changed_keys_old_and_new(tmp_path):
    from pipeline.config import TrainConfig, config_record

    stage = StageDir(tmp_path, "train")
    old_hash, old = config_record(train=TrainConfig(lr=1e-3), inputs={"layer_ids": [1, 3, 5]})
    new_hash, new = config_record(train=TrainConfig(lr=2e-3, num_anchors=8), inputs={"layer_ids": [1, 3, 5]})
    stage.begin(old_hash, settings=old)
    with pytest.raises(StageError, match=r"partial work from another config, changed:\n"
                                         r"  train.lr: 0.001 -> 0.002\n  train.num_anchors: 512 -> 8\n"
                                         r"pass --force to start over") as err:
        stage.begin(new_hash, settings=new)
    assert old_hash not in str(err.value)
    stage.write_manifest(config_hash=old_hash, fingerprint={}, started=time.time())
    assert stage.manifest()["settings"] == old
    with pytest.raises(StageError, match=r"is complete but was made with another config, changed:\n"
                                         r"  train.lr: 0.001 -> 0.002\n  train.num_anchors: 512 -> 8\n"):
        stage.begin(new_hash, settings=new)


def test_partial_work_from_another_config_is_refused(tmp_path):
    stage = StageDir(tmp_path, "extract")
    stage.begin("hash-a")
    _finish_one(stage, "u0", b"abc")
    with pytest.raises(StageError, match="partial work from another config"):
        stage.begin("hash-b")


def test_manifest_accounts_for_files_bytes_and_checksums(tmp_path):
    stage = StageDir(tmp_path, "s")
    stage.begin("h")
    _finish_one(stage, "u0", b"abc")
    _finish_one(stage, "u1", b"defg")
    m = stage.write_manifest(config_hash="h", fingerprint={}, started=time.time())
    assert m["num_units"] == 2 and m["total_bytes"] == 7
    assert {f["name"] for f in m["files"]} == {"u0.bin", "u1.bin"}
    assert all(len(f["sha256"]) == 64 for f in m["files"])
    assert read_json(stage.manifest_path)["code_version"]


def test_unit_with_a_truncated_or_corrupted_shard_is_redone(tmp_path):
    stage = StageDir(tmp_path, "s")
    stage.begin("h")
    _finish_one(stage, "u0", b"abcdef")
    assert stage.unit_done("u0") is not None
    path = stage.shard_path("u0", "bin")
    path.write_bytes(b"abcdeX")  # same size, different bytes: only the checksum sees it
    assert stage.unit_done("u0") is not None
    assert stage.unit_done("u0", verify=True) is None
    _finish_one(stage, "u1", b"abc")
    stage.shard_path("u1", "bin").write_bytes(b"ab")  # truncated: the size check sees it
    assert stage.unit_done("u1") is None


def test_fingerprint_mismatch_names_the_differing_field():
    produced = {"target": {"model": "a", "hidden_size": 64}, "layer_ids": [1, 3]}
    check_fingerprint({"layer_ids": [1, 3]}, produced, what="features", producer="extract")
    with pytest.raises(FingerprintMismatch, match=r"target\.hidden_size: this config wants 128, extract has 64"):
        check_fingerprint({"target": {"model": "a", "hidden_size": 128}}, produced, what="features", producer="extract")
    with pytest.raises(FingerprintMismatch, match=r"layer_ids"):
        check_fingerprint({"layer_ids": [2, 4]}, produced, what="features", producer="extract")


def test_rank_from_env_prefers_flags_then_torchrun_then_slurm(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN",
              "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    assert rank_from_env() == RankInfo(0, 1)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert rank_from_env() == RankInfo(1, 4)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "5")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    assert rank_from_env() == RankInfo(2, 3)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert rank_from_env() == RankInfo(3, 8)
    assert rank_from_env(1, 2) == RankInfo(1, 2)
    with pytest.raises(StageError, match="outside world size"):
        rank_from_env(2, 2)


def test_rank_slices_are_disjoint_and_cover_every_unit():
    units = [f"u{i}" for i in range(23)]
    slices = [units_for_rank(units, RankInfo(r, 4)) for r in range(4)]
    flat = [u for s in slices for u in s]
    assert sorted(flat) == sorted(units) and len(flat) == len(set(flat))


def test_atomic_write_json_roundtrip(tmp_path):
    atomic_write_json(tmp_path / "x.json", {"a": [1, 2]})
    assert read_json(tmp_path / "x.json") == {"a": [1, 2]}
    assert os.listdir(tmp_path) == ["x.json"]


def test_begin_removes_only_temp_files_of_dead_writers(tmp_path):
    """A rank relaunched while others still write must not delete their in-flight temp files."""
    stage = StageDir(tmp_path, "s")
    stage.begin("h")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    from pipeline.files import HOST

    live_tmp = stage.shards / f"a.bin.tmp-{HOST}-{live.pid}"
    dead_tmp = stage.shards / f"b.bin.tmp-{HOST}-{dead.pid}"
    other_host_tmp = stage.shards / "c.bin.tmp-otherhost-1"
    for p in (live_tmp, dead_tmp, other_host_tmp):
        p.write_bytes(b"x")
    try:
        stage.begin("h")
        assert live_tmp.exists() and other_host_tmp.exists()
        assert not dead_tmp.exists()
    finally:
        live.kill()
        live.wait()


def test_force_is_refused_for_a_rank_of_a_split_run(tmp_path):
    stage = StageDir(tmp_path, "extract")
    stage.begin("h")
    with pytest.raises(StageError, match="--force with several ranks"):
        stage.begin("h", force=True, ranks=RankInfo(1, 2))
    assert stage.begin("h", force=True, ranks=RankInfo(0, 1)) is True


def _hold_stage(run_dir, stage: str, rank: int = 0, world_size: int = 1) -> subprocess.Popen:
    """Another process that begins `stage` (taking its lock) and then sleeps."""
    code = (f"import time\nfrom pipeline.stage_dir import RankInfo, StageDir\n"
            f"StageDir(r'{run_dir}', '{stage}').begin('h', ranks=RankInfo({rank}, {world_size}))\n"
            "print('holding', flush=True); time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"holding"
    return proc


def test_a_second_process_on_a_stage_is_refused_naming_the_holder_and_a_dead_holders_lock_is_taken_over(tmp_path):
    holder = _hold_stage(tmp_path, "train")
    try:
        with pytest.raises(StageBusy, match=rf"stage 'train' at {tmp_path / 'train'} is in use by pid {holder.pid} "
                                            rf"on host {socket.gethostname()} .*wait for that run to finish"):
            StageDir(tmp_path, "train").begin("h")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    stage = StageDir(tmp_path, "train")  # the kernel dropped the dead holder's lock: taken over
    assert stage.begin("h") is True
    stage.write_manifest(config_hash="h", fingerprint={}, started=time.time())  # releases the lock
    assert (tmp_path / "train" / "lock").read_text() == ""
    assert StageDir(tmp_path, "train").begin("h") is False


def test_a_forked_child_of_a_killed_holder_does_not_keep_the_lock(tmp_path):
    code = (f"import os, time\nfrom pipeline.stage_dir import StageDir\n"
            f"StageDir(r'{tmp_path}', 'train').begin('h')\n"
            "if os.fork() == 0:\n    print(os.getpid(), flush=True); time.sleep(120); os._exit(0)\n"  # forked: running
            "time.sleep(120)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    child = int(holder.stdout.readline())
    try:
        holder.send_signal(signal.SIGKILL)  # the parent dies; its forked child (a DataLoader worker, say) lives on
        holder.wait()
        os.kill(child, 0)
        assert StageDir(tmp_path, "train").begin("h") is True
    finally:
        os.kill(child, signal.SIGKILL)


def test_ranks_of_a_split_run_lock_their_own_slice(tmp_path):
    holder = _hold_stage(tmp_path, "extract", rank=0, world_size=2)
    try:
        assert StageDir(tmp_path, "extract").begin("h", ranks=RankInfo(1, 2)) is True  # another rank: allowed
        with pytest.raises(StageBusy, match=rf"\(rank 0\) is in use by pid {holder.pid}"):
            StageDir(tmp_path, "extract").begin("h", ranks=RankInfo(0, 2))  # the same rank twice: refused
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_a_damaged_manifest_is_an_error_naming_the_file_and_the_fix(tmp_path):
    stage = StageDir(tmp_path, "extract")
    stage.begin("h")
    stage.write_manifest(config_hash="h", fingerprint={}, started=time.time())
    stage.manifest_path.write_text('{"stage": "extract", "config_')
    with pytest.raises(StageError, match=rf"{stage.manifest_path}: not valid JSON .*Delete it and run "
                                         r"`drafter extract` again"):
        stage.manifest()
