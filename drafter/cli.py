"""`drafter <command> --config X [section.key=value ...]` — the one entry point of every stage.

    drafter plan     --config configs/qwen3.6-27b.yaml
    drafter curate   --config configs/tiny.yaml
    drafter regen    --config configs/smollm2-135m.yaml regen.max_samples=64   (regenerate, then tokenize)
    drafter regen    --config ... --rank R --world-size W, then: drafter regen --merge --config ...
    drafter tokenize --config ... [--rank R --world-size W], then: drafter tokenize --merge --config ...
    drafter extract  --config ... [--rank R --world-size W] | --merge | --verify [--seed S] | --repair
    drafter train    --config ...          (torchrun --nproc-per-node 8 -m drafter.cli train ... for many GPUs)
    drafter eval     --config ... [--rank R --world-size W], then: drafter eval --merge --config ...
    drafter report   runs/a/eval runs/b/eval --out runs/compare
    drafter run      --config ...          (every stage in order)

This package sits above the stages: it is the only code that imports every one of them, and nothing imports it.
Stage code is imported lazily so `curate` and `config-reference` start fast and never import torch/vLLM.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
import traceback

from pipeline.config import RunConfig, load_config
from pipeline.errors import CPU_ALLOCATOR_FAILED, UserError, is_out_of_memory
from pipeline.stage_dir import RankInfo, StageDir, merge_ranks, rank_from_env

STAGES = ("curate", "regen", "tokenize", "extract", "train", "eval")
SPLIT_STAGES = ("regen", "tokenize", "extract", "eval")  # units sliced over ranks; `--merge` finishes a split run


def _stage_fn(name: str):
    if name == "curate":
        from pipeline.curate.stage import run_curate as fn
    elif name == "regen":
        from pipeline.regen.stage import run_regen as fn
    elif name == "tokenize":
        from pipeline.tokenize import run_tokenize as fn
    elif name == "extract":
        from extract.stage import run_extract as fn
    elif name == "train":
        from train.stage import run_train as fn
    elif name == "eval":
        from eval.stage import run_eval as fn
    else:
        raise KeyError(name)
    return fn


def _unit_names_fn(name: str):
    """`<stage module>.unit_names(cfg)`: every unit of a split stage's run, in the order ranks slice them."""
    if name == "regen":
        from pipeline.regen.stage import unit_names as fn
    elif name == "tokenize":
        from pipeline.tokenize import unit_names as fn
    elif name == "extract":
        from extract.stage import unit_names as fn
    elif name == "eval":
        from eval.stage import unit_names as fn
    else:
        raise KeyError(name)
    return fn


def merge_stage(name: str, cfg: RunConfig) -> dict:
    """`drafter <stage> --merge` after a split run: the manifest once every rank's units are done, refused (naming
    the missing units) before. One rule for every split stage: `pipeline.stage_dir.merge_ranks`."""
    before = _manifest_mtime(cfg, name)
    manifest = merge_ranks(StageDir(cfg.run_dir, name), _unit_names_fn(name)(cfg), lambda: _stage_fn(name)(cfg))
    if _manifest_mtime(cfg, name) != before:  # the merge wrote it (not the last rank, which logged already)
        _log_data_stage(name, cfg, manifest)
    return manifest


def _manifest_mtime(cfg: RunConfig, name: str) -> int | None:
    path = cfg.run_dir / name / "manifest.json"
    return path.stat().st_mtime_ns if path.exists() else None


def run_stage(name: str, cfg: RunConfig, *, force: bool = False, ranks: RankInfo | None = None) -> dict:
    """Run one stage: `run_<stage>(cfg, *, force, ranks) -> dict` (docs/design.md, "Stage contract"), which returns
    the manifest, or a rank's summary while a split run is not complete.

    The resolved config is saved beside the stage's output (`runs/<run>/<stage>/config.yaml`) when the stage ran;
    the re-run of a finished stage is a no-op that writes nothing (it works on a read-only copy of the run).
    """
    from pipeline.config import save_config

    before = _manifest_mtime(cfg, name)
    manifest = _stage_fn(name)(cfg, force=force, ranks=ranks or RankInfo())
    after = _manifest_mtime(cfg, name)
    if before is None or after is None or after != before:
        save_config(cfg, cfg.run_dir / name / "config.yaml")  # a finished stage's re-run writes nothing
        if after is not None and after != before:  # complete now (a rank of a split run returns its summary first)
            _log_data_stage(name, cfg, manifest)
    return manifest


DATA_STAGES = ("curate", "regen", "tokenize", "extract")  # train and eval log their own W&B runs


def _log_data_stage(name: str, cfg: RunConfig, manifest: dict) -> None:
    """A data stage that just finished: its counts and rates as a W&B run in the pipeline's group."""
    if name in DATA_STAGES and manifest.get("stage") == name:
        from pipeline.wandb_run import log_stage_run

        log_stage_run(cfg, name, manifest)


# command -> (what it does, an example). `drafter <command> --help` shows both; `drafter --help` the first.
COMMANDS = {
    "plan": ("estimate samples, tokens, storage, GPU-hours and (--gpus N) wall-clock of a run before anything runs, "
             "every rate with its source (writes nothing)",
             "drafter plan --config configs/qwen3-8b.yaml --gpus 8"),
    "curate": ("read, adapt, clean, dedup and mix the prompt sources into train/eval parquet shards",
               "drafter curate --config configs/tiny.yaml curate.total=200"),
    "regen": ("let the target write every assistant turn (hf or vllm backend), then tokenize",
              "drafter regen --config configs/smollm2-135m.yaml regen.max_samples=64"),
    "tokenize": ("apply the target's chat template: input_ids and an assistant-only loss mask",
                 "drafter tokenize --config configs/tiny.yaml"),
    "extract": ("store the target's hidden states at the tapped layers; --verify compares them with a fresh HF "
                "forward", "drafter extract --config configs/tiny.yaml extract.storage_dtype=fp8"),
    "train": ("train the DFlash drafter and export it in the z-lab layout that vLLM and SGLang serve",
              "drafter train --config configs/tiny.yaml train.lr=3e-4 train.max_steps=100"),
    "eval": ("decode benchmark prompts with AR, chain and DDTree: τ, per-position acceptance, speedup, report",
             "drafter eval --config configs/tiny.yaml eval.budgets=16"),
    "run": ("every stage in order (each is a no-op when already complete)",
            "drafter run --config configs/smollm2-135m.yaml"),
    "report": ("compare two or more eval runs side by side", "drafter report runs/a/eval runs/b/eval --out runs/cmp"),
    "config-reference": ("print every config key with its default and doc (docs/config.md holds the same)",
                         "drafter config-reference --markdown"),
}
CONFIG_KEYS = "every config key, its default and doc: drafter config-reference (or docs/config.md)"


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("dflash-pipeline")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


def _config_args(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    p.add_argument("--config", "-c", required=required, help="run config YAML (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, anywhere on the line: train.lr=3e-4 "
                                                "eval.budgets=16 (a single value for a list key is a one-item list)")


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="redo a finished stage (wipes its directory)")
    p.add_argument("--rank", type=int, default=None, help="this worker's rank (default: torchrun/SLURM env)")
    p.add_argument("--world-size", type=int, default=None, help="number of workers (default: torchrun/SLURM env)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="drafter", description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"`drafter <command> --help` shows a command's options and an example;\n{CONFIG_KEYS}.")
    parser.add_argument("--version", action="version", version=f"drafter {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="<command>")

    def command(name: str) -> argparse.ArgumentParser:
        text, example = COMMANDS[name]
        return sub.add_parser(name, help=text, description=text, formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog=f"example:\n  {example}\n\n{CONFIG_KEYS}.")

    plan = command("plan")
    _config_args(plan, required=True)
    plan.add_argument("--gpus", type=int, default=None, metavar="N",
                      help="also print each stage's wall-clock on N GPUs of one node (stages in sequence), with "
                           "the scaling assumed")
    for name in (*STAGES, "run"):
        p = command(name)
        _config_args(p)
        _run_args(p)
    for split_stage in SPLIT_STAGES:
        sub.choices[split_stage].add_argument(
            "--merge", action="store_true", help="after a split run (--world-size > 1): check every unit is done, write the manifest")
    ext = sub.choices["extract"]
    ext.add_argument("--verify", action="store_true", help="compare features against a fresh HF forward")
    ext.add_argument("--seed", type=int, default=0, help="with --verify: seed of the sample draw (another seed, "
                                                         "other samples)")
    ext.add_argument("--repair", action="store_true", help="re-extract only the shards that fail their checks "
                                                           "(size, header, sha256) and rebuild the index + manifest")
    ext.add_argument("--against", choices=["hf", "vllm", "stored"], default="stored",
                     help="with --verify: what to compare with HF ('stored' = the finished extraction)")
    rep = command("report")
    rep.add_argument("eval_dirs", nargs="+", help="runs/<name>/eval directories")
    rep.add_argument("--out", required=True, help="output directory for the comparison report")
    ref = command("config-reference")
    ref.add_argument("--markdown", action="store_true", help="as the markdown table of docs/config.md")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags and dotted overrides in any order (`train --config C a=1 --force b=2`): argparse stops collecting a
    positional list at the first flag, so overrides after a flag come back unrecognised and are appended here."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    later = [r for r in rest if "=" in r and not r.startswith("-")]
    if len(later) < len(rest) or (later and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(r for r in rest if r not in later) or ' '.join(later)}")
    if later:
        args.overrides = [*args.overrides, *later]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command(args.command, lambda: _dispatch(args))


REPORT_A_BUG = ("this is a bug in drafter, not in your input: please report it with the traceback above, the command "
                "line and `drafter --version`")


def run_command(command: str, fn) -> int:
    """The one error boundary: run `fn()` (a command) and turn what escapes it into an exit status.

    A `UserError` (a ConfigError, a StageError: a damaged file, a mismatched input, a busy stage, ...) or an OSError
    (no space, read-only, permission) is one line, `drafter <command>: error: <what is wrong and what to do>`, exit 2
    (a Preempted run: 75, run it again); a refusal that lists several fields puts them on indented lines below it.
    A device or host out of memory is one line too (exit 2): how much was asked of what, and the settings of that
    stage that size what it holds. Ctrl-C is one line too (exit 130). Anything else is a bug: its traceback, then
    one line asking for a report (exit 70, EX_SOFTWARE) — a bug is never hidden and a user error is never a
    traceback.
    """
    try:
        return fn()
    except UserError as e:
        print(f"drafter {command}: error: {error_message(e)}", file=sys.stderr)
        return e.exit_status
    except OSError as e:
        print(f"drafter {command}: error: {os_error_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"drafter {command}: interrupted (finished units are kept: run the same command again to resume)",
              file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the boundary: every other exception is a bug, shown in full
        if is_out_of_memory(e):  # a resource limit, not a bug
            print(f"drafter {command}: error: {out_of_memory_message(command, e)}", file=sys.stderr)
            return 2
        traceback.print_exc()
        print(f"drafter {command}: internal error: {REPORT_A_BUG}", file=sys.stderr)
        return 70


# what to do about the errors a full, read-only or foreign disk raises
OS_ERROR_FIXES = {
    errno.ENOSPC: "free space there, or point runs_dir to a larger disk; then run the same command again (finished "
                  "units are kept)",
    errno.EDQUOT: "the disk quota is used up: free space, or point runs_dir elsewhere; then run the same command "
                  "again (finished units are kept)",
    errno.EROFS: "that filesystem is mounted read-only: make it writable, or point runs_dir elsewhere",
    errno.EACCES: "this user may not write there: fix the permissions, or point runs_dir elsewhere",
    errno.EPERM: "this user may not write there: fix the permissions, or point runs_dir elsewhere",
}


# the settings that size what a stage holds on its device, to lower when it runs out of memory
OUT_OF_MEMORY_FIXES = {
    "curate": "curate.sources[].synthesize.batch_size",
    "regen": "regen.batch_size (hf backend), regen.vllm.gpu_memory_utilization or regen.vllm.max_num_seqs (vllm "
             "backend), or regen.max_model_len",
    "extract": "extract.tokens_per_batch (hf backend) or extract.vllm.gpu_memory_utilization (vllm backend)",
    "train": "train.micro_batch_tokens (raise train.grad_accum to keep the step's tokens) or turn on "
             "train.activation_checkpointing; with train.online the target is held too: train.online=false (features "
             "from extract) or ZeRO-3 (train.zero_stage=3) over more GPUs",
    "eval": "eval.budgets (the largest tree) or eval.max_new_tokens",
}


def out_of_memory_message(command: str, e: BaseException) -> str:
    """One line: what ran out and how much was asked (torch's first sentences), and what to lower in this stage."""
    text = " ".join(str(e).split())
    if CPU_ALLOCATOR_FAILED in text:
        asked = re.search(r"you tried to allocate (\d+) bytes", text)
        what = "host memory ran out" + (f" (tried to allocate {int(asked.group(1)) / 2**30:,.1f} GiB)" if asked else "")
    else:
        parts = re.findall(r"(Tried to allocate [^.]*\.\d* ?\w*|total capacity of [^.]*\.\d* ?\w* of which [^.]*\.\d* "
                           r"?\w* is free)", text)
        what = "the GPU ran out of memory" + (f" ({'; '.join(p[0].lower() + p[1:] for p in parts)})" if parts else "")
    fix = OUT_OF_MEMORY_FIXES.get(command, "the batch settings of the stage that ran out (docs/config.md)")
    return f"{what} — lower {fix}; finished units are kept: run the same command again"


def os_error_message(e: OSError) -> str:
    """One line: what the OS refused, the path, and what to do (no space, read-only, permission)."""
    if e.errno is None:
        return error_message(e)
    where = ", ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    text = os.strerror(e.errno) + (f": {where}" if where else "")
    fix = OS_ERROR_FIXES.get(e.errno)
    return f"{text} — {fix}" if fix else text


def error_message(e: BaseException) -> str:
    """The message of a stage error; one raised in a DataLoader worker arrives wrapped in the worker's traceback,
    of which only the original message is kept. Lines after the first (the fields a refusal lists) are indented
    under the error line."""
    text = str(e)
    if "Original Traceback" in text:
        last = re.search(rf"\n(?:[\w.]+\.)?{type(e).__name__}: (.*)\Z", text, re.S)
        if last:
            text = last.group(1).strip()
    first, *rest = text.strip().split("\n") or [""]
    return "\n".join([first, *(f"  {line.strip()}" for line in rest if line.strip())])


def _dispatch(args) -> int:
    if args.command == "config-reference":
        from pipeline.config import describe_fields, reference_markdown

        if args.markdown:
            print(reference_markdown(), end="")
            return 0
        for key, default, text in describe_fields():
            print(f"{key:40s} {default:24s} {text}")
        return 0
    if args.command == "report":
        from eval.report import compare_runs

        print(compare_runs(args.eval_dirs, args.out))
        return 0
    cfg = load_config(args.config, args.overrides)
    if args.command == "plan":
        from drafter.plan import estimate, format_plan

        print(format_plan(cfg, estimate(cfg, gpus=args.gpus)))
        return 0
    ranks = rank_from_env(args.rank, args.world_size)
    if args.command == "extract" and args.verify:
        from extract.verify import run_verify

        return 0 if run_verify(cfg, against=args.against, seed=args.seed)["passed"] else 1
    if args.command == "extract" and args.repair:
        from extract.stage import repair_extract

        repair_extract(cfg)
        return 0
    if getattr(args, "merge", False):
        merge_stage(args.command, cfg)
        if args.command == "regen":
            run_stage("tokenize", cfg)  # what a single-rank `drafter regen` does next
        return 0
    if args.command == "run":
        for name in STAGES:
            run_stage(name, cfg, force=args.force, ranks=ranks)
        return 0
    run_stage(args.command, cfg, force=args.force, ranks=ranks)
    if args.command == "regen" and not ranks.is_split:
        run_stage("tokenize", cfg, force=args.force, ranks=ranks)  # `drafter regen` yields tokenized data
    return 0


if __name__ == "__main__":
    sys.exit(main())
