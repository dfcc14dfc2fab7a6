"""The stage contract of docs/design.md is what the code does: every stage function has the one documented signature,
every split stage gives `drafter <stage> --merge` its unit names, and the design doc states both as the code has
them (the signature line, the list of split stages)."""

from __future__ import annotations

import inspect
from pathlib import Path

from drafter.cli import SPLIT_STAGES, STAGES, _stage_fn, _unit_names_fn
from pipeline.stage_dir import RankInfo

REPO = Path(__file__).resolve().parents[2]
CONTRACT = "run_<stage>(cfg: RunConfig, *, force: bool = False, ranks: RankInfo = RankInfo()) -> dict"
UNIT_NAMES = "unit_names(cfg: RunConfig) -> list[str]"


def signature_line(fn, name: str) -> str:
    """`fn`'s signature written as design.md writes it (annotations as written, `RankInfo()` for the default)."""
    sig = inspect.signature(fn)
    params, star = [], False
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            params.append("*")
            star = True
        text = f"{p.name}: {p.annotation}" if p.annotation is not p.empty else p.name
        if p.default is not p.empty:
            text += " = " + ("RankInfo()" if p.default == RankInfo() else repr(p.default))
        params.append(text)
    return f"{name}({', '.join(params)}) -> {sig.return_annotation}"


def design_contract_section() -> str:
    design = (REPO / "docs/design.md").read_text()
    start = design.index("## Stage contract")
    return design[start:design.index("\n## ", start + 1)]


def test_every_stage_function_has_the_one_documented_signature():
    for stage in STAGES:
        fn = _stage_fn(stage)
        assert fn.__name__ == f"run_{stage}"
        assert signature_line(fn, "run_<stage>") == CONTRACT, f"run_{stage}"
    assert f"`{CONTRACT}`" in design_contract_section()


def test_every_split_stage_names_its_units_for_the_merge_and_the_doc_lists_them():
    for stage in SPLIT_STAGES:
        assert signature_line(_unit_names_fn(stage), "unit_names") == UNIT_NAMES, stage
    section = design_contract_section()
    assert f"`{UNIT_NAMES}`" in section
    listed = "split stages (`drafter.cli.SPLIT_STAGES`): " + ", ".join(f"`{s}`" for s in SPLIT_STAGES)
    assert listed in " ".join(section.split()), "design.md does not list the split stages as drafter.cli has them"


def test_the_signature_check_sees_a_stage_that_breaks_the_contract():
    def run_bad(cfg: RunConfig, force: bool = False, *, ranks: RankInfo | None = None) -> dict | None:  # noqa: F821
        pass

    assert signature_line(run_bad, "run_<stage>") != CONTRACT
    assert signature_line(run_bad, "run_<stage>") == \
        "run_<stage>(cfg: RunConfig, force: bool = False, *, ranks: RankInfo | None = None) -> dict | None"
