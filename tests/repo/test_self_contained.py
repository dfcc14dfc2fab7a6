"""The repository stands alone: no tracked file reads or cites a path outside it, and everything a config or
the demo reads is tracked."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]

# A path that climbs out of the checkout into the folder of reference notes that sits beside a development
# checkout, an absolute path into the development machines' folders, or a section citation (`<notes>.md §N`) of
# those notes. (The examples in the second test are assembled from pieces so that this file passes its own scan.)
OUTSIDE = re.compile(
    r"\.\./shared|\.parent\s*/\s*[\"']shared[\"']|/work/(?:main|shared|helpers|wt)\b"
    r"|\b(?:dflash|ddtree|pipelines|environment|slurm-local|architecture|style)\.md\s*§"
    r"|(?:pitfall|notes)\s*§|\(§\d"
)


LOCAL_ONLY = {".git", ".venv", ".cache", "runs", "wandb", ".pytest_cache", "__pycache__"}


def tracked_files() -> list[Path]:
    """git's tracked files; in a copy without git metadata, every file outside local environments and outputs."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True)
    if out.returncode == 0:
        return [REPO / p for p in out.stdout.decode().split("\0") if p]
    return [p for p in REPO.rglob("*") if p.is_file() and not LOCAL_ONLY & set(p.relative_to(REPO).parts)]


def test_no_tracked_file_points_outside_the_repository():
    hits = []
    for path in tracked_files():
        if path.suffix in {".parquet", ".png", ".safetensors"} or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:120]}")
    assert not hits, "tracked lines point outside the repository:\n" + "\n".join(hits)


def test_the_outside_path_check_catches_what_it_should():
    shared = "sha" + "red"
    for line in [f'open("../{shared}/data/prompts/x.jsonl")', f'REPO.parent / "{shared}" / "data"',
                 "# see dflash.md " + "§4.4", "(pitfall " + "§6.1)", "lossless (" + "§3.3)", f"cat /work/{shared}/docs/ddtree.md"]:
        assert OUTSIDE.search(line), line
    for line in ["docs/drafter.md, \"Layer ids\"", "data/prompts/gsm8k_train.parquet", "../x = y / z"]:
        assert not OUTSIDE.search(line), line


def test_every_local_file_a_config_reads_is_tracked():
    tracked = {p.relative_to(REPO).as_posix() for p in tracked_files()}
    for config in sorted((REPO / "configs").glob("*.yaml")):
        data = yaml.safe_load(config.read_text())
        paths = [s["path"] for s in (data.get("curate") or {}).get("sources", [])]
        paths += [b["path"] for b in (data.get("eval") or {}).get("benchmarks", []) if b.get("path")]
        for p in paths:
            if p.startswith("data/"):
                assert p in tracked, f"{config.name} reads {p}, which is not in the repository"
