"""The repository stands alone: no tracked file reads or cites a path outside it (CI's own script may point the
data mirror setting at the mirror beside the checkout), it holds no third-party dataset, and every config names its
prompt sets by their public identity (or needs none), never by a file in or outside the repository."""

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


# The one exception: CI's script sets DRAFTER_DATA_DIR to the prompt mirror beside the original checkout.
ALLOWED = {".ci/run": re.compile(r'^\s*mirror="\$repo/\.\./shared/data/prompts"\s*(#.*)?$')}


def outside_lines(path: Path) -> list[str]:
    """`file:line: text` of every line of a tracked file that points outside the repository (ALLOWED aside)."""
    rel = path.relative_to(REPO).as_posix()
    text = path.read_text(encoding="utf-8", errors="replace")
    return [f"{rel}:{n}: {line.strip()[:120]}" for n, line in enumerate(text.splitlines(), 1)
            if OUTSIDE.search(line) and not (rel in ALLOWED and ALLOWED[rel].match(line))]


def test_no_tracked_file_points_outside_the_repository():
    hits = []
    for path in tracked_files():
        if path.suffix in {".parquet", ".png", ".safetensors"} or not path.is_file():
            continue
        hits += outside_lines(path)
    assert not hits, "tracked lines point outside the repository:\n" + "\n".join(hits)


def test_ci_may_name_the_mirror_beside_the_checkout_and_nothing_else(tmp_path):
    shared = "sha" + "red"
    ci = REPO / ".ci" / "run"
    assert ALLOWED[".ci/run"].match(f'mirror="$repo/../{shared}/data/prompts"')
    assert any(ALLOWED[".ci/run"].match(line) for line in ci.read_text().splitlines())  # the exception is used
    for line in [f'cat "$repo/../{shared}/data/prompts/gsm8k.jsonl"', f'mirror="$repo/../{shared}/docs"',
                 f'export DRAFTER_DATA_DIR=/work/{shared}/data/prompts']:
        assert OUTSIDE.search(line) and not ALLOWED[".ci/run"].match(line), line


def test_the_outside_path_check_catches_what_it_should():
    shared = "sha" + "red"
    for line in [f'open("../{shared}/data/prompts/x.jsonl")', f'REPO.parent / "{shared}" / "data"',
                 "# see dflash.md " + "§4.4", "(pitfall " + "§6.1)", "lossless (" + "§3.3)", f"cat /work/{shared}/docs/ddtree.md"]:
        assert OUTSIDE.search(line), line
    for line in ["docs/drafter.md, \"Layer ids\"", "data/prompts/gsm8k_train.parquet", "../x = y / z"]:
        assert not OUTSIDE.search(line), line


def test_the_repository_holds_no_dataset():
    """No data/ directory, no dataset file (parquet, arrow, csv; jsonl only as the logs of docs/results), no vendored
    set's licence file: public prompt sets come from their source or a mirror, tests write their own."""
    files = [p.relative_to(REPO).as_posix() for p in tracked_files()]
    assert not [f for f in files if f.startswith("data/")]
    assert not [f for f in files if Path(f).suffix in {".parquet", ".arrow", ".csv", ".tsv"}]
    assert not [f for f in files if Path(f).suffix == ".jsonl" and not f.startswith("docs/results/")]
    assert not [f for f in files if Path(f).name.startswith("LICENSE.")]


def test_configs_name_every_prompt_set_by_its_public_identity_or_need_none():
    for config in sorted((REPO / "configs").glob("*.yaml")):
        data = yaml.safe_load(config.read_text())
        entries = [(f"curate.sources[{i}]", s) for i, s in enumerate((data.get("curate") or {}).get("sources", []))]
        entries += [(f"eval.benchmarks[{i}]", b) for i, b in enumerate((data.get("eval") or {}).get("benchmarks", []))]
        assert entries, config.name
        for key, e in entries:
            assert not e.get("path"), f"{config.name} {key} reads a local file: {e['path']}"
            generated = e.get("synthesize") or e.get("random_words") or e.get("name") == "held_out"
            assert generated or [k for k in ("hub", "url", "origin") if e.get(k)], f"{config.name} {key}"
