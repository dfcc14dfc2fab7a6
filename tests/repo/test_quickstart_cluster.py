"""docs/quickstart-cluster.md holds: every command in its ```bash blocks is run in dry-run form — a `drafter` command
parses with the CLI's own parser and its config loads and validates (overrides included), `slurm/pipeline.sh` runs
with --dry-run, `make` targets exist (make -n), a benchmark script knows every flag given, the torch it installs is
one pyproject admits, the serving commands give the engines what the config's export is (its path, B-1 tokens for
vLLM, B for SGLang) — and a command of a kind this test does not know fails it, so the page cannot grow unchecked
commands. The `plan` output pasted in it is what `drafter plan` prints now. The README's and docs/serving.md's serving
commands are held to the same check."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from drafter.cli import main, parse_args
from pipeline.config import load_config

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "quickstart-cluster.md"
# Commands whose program is no part of this repository: checked for shell syntax (bash -n) and, where they name a
# file of the repository, for that file.
EXTERNAL = {"git", "cd", "wandb", "hf", "cat"}
ASSIGN = re.compile(r"[A-Z_][A-Z0-9_]*=")


def blocks(text: str, lang: str) -> list[tuple[int, str]]:
    """(offset, body) of every fenced block of `lang`."""
    return [(m.start(), m.group(1)) for m in re.finditer(rf"```{lang}\n(.*?)```", text, re.S)]


def commands(text: str) -> list[tuple[dict, list[str]]]:
    """(environment assignments, argv) of every command line of the ```bash blocks (comments dropped)."""
    out = []
    for _, body in blocks(text, "bash"):
        for line in body.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            env = {}
            while argv and ASSIGN.match(argv[0]):
                k, v = argv.pop(0).split("=", 1)
                env[k] = v
            if argv:
                out.append((env, argv))
    return out


def check_config(path: str, overrides: list[str]):
    assert (REPO / path).is_file(), f"{path} does not exist"
    return load_config(REPO / path, overrides)  # raises ConfigError on a wrong key or value


def check_drafter(argv: list[str]) -> None:
    if argv == ["--version"]:
        return
    args = parse_args(argv)
    if getattr(args, "config", None):
        check_config(args.config, args.overrides)


def check_vllm_serve(argv: list[str]) -> None:
    assert argv[1] == "serve", argv
    target = argv[2]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    cfg = config_of_export(spec["model"])
    assert target == cfg.target.model and spec["method"] == "dflash"
    assert spec["num_speculative_tokens"] == cfg.drafter.block_size - 1, "vLLM counts B-1 speculative tokens"


def check_sglang(argv: list[str]) -> None:
    opt = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1, 2)}
    cfg = config_of_export(opt["--speculative-draft-model-path"])
    assert opt["--model-path"] == cfg.target.model and opt["--speculative-algorithm"] == "DFLASH"
    assert int(opt["--speculative-num-draft-tokens"]) == cfg.drafter.block_size, "SGLang counts the whole block"


def config_of_export(path: str):
    """The config whose run exports to `path` (runs/<name>/train/export)."""
    m = re.fullmatch(r"runs/([\w.-]+)/train/export", path)
    assert m, f"{path} is not a run's export dir"
    for c in sorted((REPO / "configs").glob("*.yaml")):
        cfg = load_config(c, [])
        if cfg.name == m.group(1):
            return cfg
    raise AssertionError(f"no config in configs/ is named {m.group(1)!r}")


def check_script(argv: list[str]) -> None:
    script = REPO / argv[0]
    assert script.is_file(), argv[0]
    source = script.read_text()
    for flag in (a for a in argv[1:] if a.startswith("--")):
        assert f'"{flag}"' in source, f"{argv[0]} has no flag {flag}"
    if "--config" in argv:
        check_config(argv[argv.index("--config") + 1], [])


def check_pip(argv: list[str]) -> None:
    assert argv[1] == "install"
    torch = next(a for a in argv if a.startswith("torch=="))
    version = torch.split("==")[1]
    pins = {Requirement(r).name: Requirement(r).specifier for r in pyproject_dependencies()}
    assert version in pins["torch"], f"pyproject's torch pin {pins['torch']} refuses {torch}"


def pyproject_dependencies() -> list[str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


def check_pipeline_sh(env: dict, argv: list[str]) -> None:
    assert "CONFIG" in env, "slurm/pipeline.sh needs CONFIG="
    check_config(env["CONFIG"], shlex.split(env.get("ARGS", "")))
    run_env = {**os.environ, **env, "DRAFTER_VENV": os.environ.get("VIRTUAL_ENV", str(REPO / ".venv"))}
    flags = argv[1:] + ([] if "--dry-run" in argv else ["--dry-run"])
    out = subprocess.run(["bash", "slurm/pipeline.sh", *flags], cwd=REPO, env=run_env, text=True,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    jobs = [line.split()[0] for line in out.stdout.strip().splitlines()]
    assert jobs[0] == "curate" and jobs[-1].startswith("eval"), out.stdout
    assert all(env.get("SBATCH_FLAGS", "") in line for line in out.stdout.splitlines())


def check_command(env: dict, argv: list[str]) -> None:
    prog = argv[0]
    if prog == "drafter":
        check_drafter(argv[1:])
    elif prog == "torchrun":
        i = argv.index("-m")
        assert argv[i + 1] == "drafter.cli", argv
        check_drafter(argv[i + 2:])
    elif prog == "slurm/pipeline.sh":
        check_pipeline_sh(env, argv)
    elif prog == "make":
        out = subprocess.run(["make", "-n", *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"make {argv[1:]}: {out.stderr}"
    elif prog == "vllm":
        check_vllm_serve(argv)
    elif prog == "python" and argv[1:3] == ["-m", "sglang.launch_server"]:
        check_sglang(argv)
    elif prog == "python" and argv[1].endswith(".py"):
        check_script(argv[1:])
    elif prog == "python3" and argv[1:3] == ["-m", "venv"]:
        pass
    elif prog == ".venv/bin/pip":
        check_pip(argv)
    elif prog == "source":
        assert argv[1:] == [".venv/bin/activate"], "the environment make setup / setup-gpu builds is .venv"
        assert re.search(r"^VENV\s*\?=\s*\.venv$", (REPO / "Makefile").read_text(), re.M)
    elif prog in EXTERNAL:
        for a in argv[1:]:  # a repository file it names (not a run output) must exist
            if re.fullmatch(r"(configs|slurm|docs|benchmarks)/\S+", a):
                assert (REPO / a).exists(), a
    else:
        raise AssertionError(f"a command this test does not check: {shlex.join(argv)} (add a check for {prog!r})")


def test_the_quickstart_is_valid_bash():
    for _, body in blocks(DOC.read_text(), "bash"):
        out = subprocess.run(["bash", "-n"], input=body, text=True, capture_output=True)
        assert out.returncode == 0, f"{body}\n{out.stderr}"


@pytest.mark.slow
def test_every_quickstart_command_runs_in_dry_run_form_and_its_configs_validate():
    cmds = commands(DOC.read_text())
    for env, argv in cmds:
        check_command(env, argv)
    progs = [argv[:2] for _, argv in cmds]
    # the path from zero to a served drafter is all there: install, plan for 8 GPUs, SLURM, W&B, eval, serving
    for step in (["make", "setup-gpu"], ["drafter", "plan"], ["slurm/pipeline.sh"], ["wandb", "login"],
                 ["drafter", "eval"], ["vllm", "serve"]):
        assert any(p[:len(step)] == step for p in progs), f"the quickstart has no {' '.join(step)}"
    assert any(argv[:2] == ["drafter", "plan"] and "--gpus" in argv and "configs/qwen3-8b.yaml" in argv
               for _, argv in cmds)


def test_a_command_the_check_does_not_know_fails_it():
    with pytest.raises(AssertionError, match="a command this test does not check"):
        check_command({}, ["sbatch", "slurm/train.sbatch"])
    with pytest.raises(AssertionError, match="B-1"):
        check_vllm_serve(["vllm", "serve", "Qwen/Qwen3-8B", "--speculative-config",
                          '{"method": "dflash", "model": "runs/qwen3-8b/train/export", "num_speculative_tokens": 16}'])


def test_the_plan_output_in_the_quickstart_is_what_plan_prints(tmp_path, capsys):
    """Each ```text block after a `drafter plan` command: the whole output when it starts with the plan's first line,
    else lines of it."""
    text = DOC.read_text()
    plans = [(off, argv) for (off, body) in blocks(text, "bash") for env, argv in commands(f"```bash\n{body}```")
             if argv[:2] == ["drafter", "plan"]]
    outputs = blocks(text, "text")
    assert plans and outputs
    for off, argv in plans:
        pasted = next(body for o, body in outputs if o > off)
        argv = [a if not a.endswith(".yaml") else str(REPO / a) for a in argv]
        assert main([*argv[1:], f"runs_dir={tmp_path}"]) == 0  # an empty runs dir: nothing measured is read
        printed = capsys.readouterr().out
        if pasted.startswith("plan for run"):
            assert pasted == printed, "docs/quickstart-cluster.md: paste `drafter plan` again"
        else:
            lines = printed.splitlines()
            assert all(line in lines for line in pasted.splitlines()), printed


@pytest.mark.parametrize("doc", ["README.md", "docs/serving.md", "docs/quickstart-cluster.md"])
def test_the_serving_commands_in_the_docs_fit_the_export_of_their_config(doc):
    cmds = [argv for _, argv in commands((REPO / doc).read_text()) + indented_commands((REPO / doc).read_text())
            if argv[0] == "vllm" or argv[1:3] == ["-m", "sglang.launch_server"]]
    assert any(a[0] == "vllm" for a in cmds) and any(a[0] == "python" for a in cmds), doc
    for argv in cmds:
        check_command({}, argv)


def indented_commands(text: str) -> list[tuple[dict, list[str]]]:
    """Commands in 4-space indented code lines (docs/serving.md's style) that start a serving engine."""
    return [({}, shlex.split(line.strip())) for line in text.splitlines()
            if line.startswith("    vllm serve ") or line.startswith("    python -m sglang.launch_server ")]
