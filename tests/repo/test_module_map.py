"""The module map holds: imports follow the order pipeline -> extract -> dflash_model -> train -> eval -> drafter (no
module imports a later package, nothing below the entry point imports it; train and eval share the drafter model
through dflash_model, and eval imports nothing of train), the decoding engine (eval/engine/) imports nothing of the
eval stage, and docs/design.md names every module."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAGE_ORDER = ["pipeline", "extract", "dflash_model", "train", "eval", "drafter"]  # drafter/ = the entry point


def modules() -> list[Path]:
    return sorted(p for pkg in STAGE_ORDER for p in (REPO / pkg).rglob("*.py"))


def imported_packages(source: str) -> list[tuple[int, str]]:
    """(line, dotted module) of every absolute import of a project package in `source`, function-level included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in STAGE_ORDER]
    return found


def backward_imports(source: str, package: str) -> list[tuple[int, str]]:
    """The imports in a module of `package` that name a package later in STAGE_ORDER."""
    own = STAGE_ORDER.index(package)
    return [(line, name) for line, name in imported_packages(source) if STAGE_ORDER.index(name.split(".")[0]) > own]


def test_no_module_imports_a_later_stage_or_the_entry_point():
    assert len(modules()) > 50
    bad = [f"{path.relative_to(REPO)}:{line} imports {name}" for path in modules()
           for line, name in backward_imports(path.read_text(), path.relative_to(REPO).parts[0])]
    assert not bad, "imports against " + " -> ".join(STAGE_ORDER) + ":\n" + "\n".join(bad)


def test_the_check_sees_lazy_and_plain_backward_imports():
    """The check is not vacuous: function-level imports of a later stage or of the entry point are reported."""
    source = "import pipeline.config\nfrom extract import store\ndef f():\n    from eval.stage import run_eval\n" \
             "    import drafter.cli\n"
    assert backward_imports(source, "pipeline") == [(2, "extract"), (4, "eval.stage"), (5, "drafter.cli")]
    assert backward_imports(source, "eval") == [(5, "drafter.cli")]
    assert backward_imports(source, "drafter") == []


def imports_across(source: str, forbidden) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in `source` that `forbidden(dotted module)` refuses."""
    return [(line, name) for line, name in imported_packages(source) if forbidden(name)]


def is_train(name: str) -> bool:
    return name.split(".")[0] == "train"


def is_eval_stage_side(name: str) -> bool:
    """An eval module outside the engine (`from eval import x` names the stage side too)."""
    return name == "eval" or (name.startswith("eval.") and not (name + ".").startswith("eval.engine."))


def test_eval_imports_nothing_of_train():
    """train and eval share the drafter model through dflash_model; the evaluator never reaches into the trainer."""
    bad = [f"{path.relative_to(REPO)}:{line} imports {name}" for path in (REPO / "eval").rglob("*.py")
           for line, name in imports_across(path.read_text(), is_train)]
    assert not bad, "eval imports train (use dflash_model):\n" + "\n".join(bad)


def test_the_engine_imports_nothing_of_the_eval_stage():
    engine = sorted((REPO / "eval" / "engine").rglob("*.py"))
    assert len(engine) > 10
    bad = [f"{path.relative_to(REPO)}:{line} imports {name}" for path in engine
           for line, name in imports_across(path.read_text(), is_eval_stage_side)]
    assert not bad, "the engine (eval/engine/) imports the eval stage:\n" + "\n".join(bad)


def test_the_boundary_checks_see_what_they_forbid():
    source = ("from eval.engine.tree import Tree\nfrom eval import prompts\ndef f():\n    from eval.stage import run_eval\n"
              "    import train.loss\n    from dflash_model.model import DFlashDrafter\nimport eval.engine\n")
    assert imports_across(source, is_eval_stage_side) == [(2, "eval"), (4, "eval.stage")]
    assert imports_across(source, is_train) == [(5, "train.loss")]


def test_design_md_names_every_module_by_its_path():
    design = (REPO / "docs/design.md").read_text()
    missing = [str(p.relative_to(REPO)) for p in modules()
               if p.name != "__init__.py" and f"`{p.relative_to(REPO)}`" not in design]
    assert not missing, "docs/design.md, 'One place per concept', has no row for: " + ", ".join(missing)
