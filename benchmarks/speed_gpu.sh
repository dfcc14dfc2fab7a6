#!/usr/bin/env bash
# The SmolLM2 recipe's stage speeds on one GPU in one command (issue 29: regen >= 100K generated tokens/s, training
# >= 200K tokens/s): each lever built for them timed against what it replaced, with the profile that says where the
# rest goes, and the CUDA tests of those paths. Random-init SmolLM2-shape target (weights do not change the speed;
# no GGUF needed); regen's prompts are the demo config's sets, read from DRAFTER_DATA_DIR or --data.
#
#   bash benchmarks/speed_gpu.sh --out "$OUT" --data .bundle/data-small --tokenizer .bundle/data-small/smollm2-tokenizer
#        (one device call; the next call of the same command goes on where this one stopped)
#   bash benchmarks/speed_gpu.sh --cpu-smoke --out /tmp/speed             (here: every step at toy size on the CPU)
#
# The GPU machine reads no mirror: carry the three prompt files regen reads in a git-ignored folder, e.g.
#   mkdir -p .bundle/data-small && cp "$DRAFTER_DATA_DIR"/{gsm8k_train.jsonl,code_alpaca_2k.json,alpaca_seed_tasks.jsonl} .bundle/data-small/
# (a few MB; the device tool's `carry` takes .bundle/data-small). torch, transformers and triton are the machine's own.
# --tokenizer DIR tokenizes regen's prompts with SmolLM2's own tokenizer (without it: the byte tokenizer, whose prompts
# are several times longer than the real ones, so every row attends over a longer context and needs more K/V);
# after the tests or `make demo` converted the GGUF, its tokenizer files are
#   mkdir -p .bundle/data-small/smollm2-tokenizer && cp .cache/targets/smollm2-135m-instruct/{tokenizer.json,tokenizer_config.json,chat_template.jinja} .bundle/data-small/smollm2-tokenizer/
#
# Steps, in order, each run once per --work (markers; --retry STEP runs one again, --skip STEP leaves it out,
# --first A,B runs those ahead of the rest):
#   env     GPU, torch, triton
#   tests   the CUDA tests of the regen fast path (static decode on graphs, bf16 GEMM attention, compiled pointwise)
#           and of the training step (no host sync, with and without distillation)
#   regen   bench_regen.py --shape smollm2-135m: the static decode with cuDNN's fused attention (static-sdpa), with
#           the GEMM attention (static, the default), and with norms / MLPs / RoPE compiled (static-compiled), at
#           each batch of REGEN_BATCHES (default 512,1024), 2,048 prompts x <= 256 tokens within 2,048 of context (as
#           the stage: longer prompts left out and counted), the middle batch of each row profiled; greedy
#   sampled the same prompts as the recipe's regen stage runs them: its sampling (temperature 0.7, top-p 0.95: a
#           sort of the vocabulary per row per step), its limit (384) and answers as long as its real ones
#           (bench_regen --answer-lengths recipe: batches run to their longest answer and compact as rows finish),
#           static-compiled at each batch of REGEN_BATCHES, profiled
#   train   bench_train.py --shape smollm2: TRAIN_VARIANTS (default: the recipe's online compiled step with CE, with
#           CE+KL (the recipe's loss: its target logits now per position), and with 64 anchors per sample)
# Writes results.jsonl, steps.log, summary.md, json/ (every step's JSON) and logs.tgz into --out.
# PYTHON=... picks the interpreter. Exit status 0 unless the arguments are wrong.
set -uo pipefail
export PYTHONUNBUFFERED=1 DRAFTER_NO_PROGRESS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
OUT="" WORK="/tmp/speed-gpu" BUDGET_S=560 SMOKE="" DATA="" TOKENIZER="" RETRY=() SKIP=() FIRST=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    --data) DATA="$2"; shift 2 ;;
    --tokenizer) TOKENIZER="$2"; shift 2 ;;
    --budget-s) BUDGET_S="$2"; shift 2 ;;
    --cpu-smoke) SMOKE=1; shift ;;
    --retry) RETRY+=("$2"); shift 2 ;;
    --skip) SKIP+=("$2"); shift 2 ;;
    --first) IFS=, read -ra FIRST <<< "$2"; shift 2 ;;
    *) echo "speed_gpu.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
STEPS=(env tests regen sampled train)
[ -n "$OUT" ] || { echo "speed_gpu.sh: --out DIR is required" >&2; exit 2; }
if [ -n "$DATA" ]; then
  [ -d "$DATA" ] || { echo "speed_gpu.sh: --data $DATA is not a directory" >&2; exit 2; }
  export DRAFTER_DATA_DIR="$(cd "$DATA" && pwd)"
fi
source benchmarks/gpu_steps.sh  # begin_steps, left, log, step, timeboxed
check_tokenizer speed_gpu.sh
begin_steps speed_gpu.sh
finish() {
  cp "$WORK/results.jsonl" "$WORK/steps.log" "$OUT/" 2>/dev/null
  [ -f "$WORK/summary.md" ] && cp "$WORK/summary.md" "$OUT/"
  mkdir -p "$OUT/json" && cp "$WORK"/json/*.json "$OUT/json/" 2>/dev/null
  tar -czf "$OUT/logs.tgz" -C "$WORK" logs json 2>/dev/null
  log "call ends; done: $(cd "$WORK" && ls done.* 2>/dev/null | sed 's/done\.//' | tr '\n' ' ')"
}
trap finish EXIT

TEST_FILES=(tests/pipeline/test_regen_hf.py tests/train/test_step_no_host_sync.py)
if [ -n "$SMOKE" ]; then  # here: toy sizes on the CPU (CUDA-only tests are collected, not run)
  DEVICE=cpu; export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  : "${DRAFTER_DATA_DIR:?--cpu-smoke: regen reads the prompt mirror, set DRAFTER_DATA_DIR or pass --data}"
  REGEN_ARGS=(--shape tiny --dtype float32 --num-prompts 8 --max-new-tokens 8 --batch-size 4,8
              --modes static-sdpa,static --threads 1)
  SAMPLED_ARGS=(--shape tiny --dtype float32 --num-prompts 8 --max-new-tokens 8 --answer-lengths recipe --batch-size 4
                --modes static --threads 1)
  TRAIN_ARGS=(--shape tiny --variants trainer-dense-online,trainer-dense-online-kl --seqs 2 --steps 1 --warmup 0
              --engine torch)
else
  DEVICE=cuda
  REGEN_ARGS=(--shape smollm2-135m --dtype bfloat16 --num-prompts 2048 --max-new-tokens 256
              --batch-size "${REGEN_BATCHES:-512,1024}" --modes static-sdpa,static,static-compiled --profile
              ${TOKENIZER:+--tokenizer "$TOKENIZER"})
  SAMPLED_ARGS=(--shape smollm2-135m --dtype bfloat16 --num-prompts 2048 --max-new-tokens 384 --answer-lengths recipe
                --batch-size "${REGEN_BATCHES:-512,1024}" --modes static-compiled --profile
                ${TOKENIZER:+--tokenizer "$TOKENIZER"})
  TRAIN_ARGS=(--shape smollm2 --engine torch --variants "${TRAIN_VARIANTS:-trainer-flex-compile-online,trainer-flex-compile-online-kl,trainer-flex-compile-online-anc64}")
fi

step_env() {
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"; }
  "$PY" -c 'import platform, torch, transformers
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = None
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__, "triton", tv)'
}

step_tests() {
  if [ -n "$SMOKE" ]; then
    timeboxed "$PY" -m pytest -q -p no:cacheprovider --collect-only "${TEST_FILES[@]}" -k "cuda or never_waits"
    return $?
  fi
  timeboxed "$PY" -m pytest -q -p no:cacheprovider --tb=short "${TEST_FILES[@]}" -k "cuda or never_waits"
}

step_regen() {
  timeboxed "$PY" benchmarks/bench_regen.py --device $DEVICE "${REGEN_ARGS[@]}" --json "$WORK/json/regen.json"
}

step_sampled() {
  timeboxed "$PY" benchmarks/bench_regen.py --device $DEVICE "${SAMPLED_ARGS[@]}" --temperature 0.7 --top-p 0.95 \
    --json "$WORK/json/regen-sampled.json"
}

step_train() {
  timeboxed "$PY" benchmarks/bench_train.py --device $DEVICE "${TRAIN_ARGS[@]}" --json "$WORK/json/train.json"
}

step env 30
run_steps tests:150 regen:300 sampled:200 train:300
[ -f "$WORK/done.train" ] && log "all steps done"
exit 0
