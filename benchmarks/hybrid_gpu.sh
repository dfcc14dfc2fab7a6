#!/usr/bin/env bash
# Every GPU number of a hybrid (Gated-DeltaNet) target in one command: the Qwen3.6-27B shape (random-init, the real
# layout) on one H200, each stage at speed, written to --out/summary.json with the keys of
# docs/results/hybrid-h200/summary.json (chain_verify_ms, tree_verify_ms, overhead_ms, extract_tok_s,
# extract_ceiling_tok_s, ... plus regen_tok_s {generate, static} at batch 256 and train_tok_s).
#
#   bash benchmarks/hybrid_gpu.sh --out "$OUT" [--bundle .bundle]   (H200: the same command in every call; a call
#                                                                    runs what fits in --budget-s, the next goes on)
#   bash benchmarks/hybrid_gpu.sh --cpu-smoke --out /tmp/hg-out     (here: every step at toy size on the CPU)
#
# Steps, in order, each run once (a marker in --work records it, failed or not; --retry STEP runs it again):
#   env       GPU, torch, transformers, fla-core (required on the GPU: the Gated-DeltaNet kernels)
#   tests     the CUDA-only hybrid tests: Triton tree kernels, tree-aware verify vs the path-batched reference with no
#             host sync, the graphed commit equal to the eager one, greedy hybrid rounds, hybrid static regen on
#             graphs equal to generate, extraction on fla's kernels, fla's short convolution equal to torch's (CPU
#             smoke: the selection is collected only)
#   regen     bench_regen.py --shape qwen3.6-27b: the static-decode loop vs `generate` at batch 64 and 256, each row
#             beside its compute and memory roofline, each static row's middle batch profiled (kernels, host ops)
#   round     bench_hybrid.py verify + reference sections on the graphed cache: chain / tree verify, the round
#             overhead (build + walk + read + commit + gather) per budget up to 256, host syncs, its profile
#   commit    bench_gdn_commit.py: the device commit of every Gated-DeltaNet layer by piece beside a copy of the
#             states (its memory floor), the state kernel at several block shapes
#   extract   bench_hybrid.py extract section: the stage end to end, bf16 and fp8 features, beside the compute
#             roofline and the disk ceiling
#   train     bench_train.py --shape qwen3.6-27b: online training with the 27B target resident ([S,S,S,S,F] drafter,
#             window 2048, seq 3072, 512 anchors): tokens/s, step = target forward + drafter, peak memory, MFU
#   trainmax  bench_train.py --max-batch: the largest micro-batch (sequences in one row) that fits beside the target
# --skip STEP (repeatable) leaves a step out of this --work: the summary names it under "missing". --first A,B runs
# those steps (after env) ahead of the rest, e.g. a long one at the start of a fresh call.
# A step starts only when the call has the time it needs left (--budget-s, default 560 s: one device call is at most
# 10 minutes). Each call ends by writing summary.json (benchmarks/hybrid_gpu_summary.py: what the steps so far
# measured, the steps that failed or did not run named) and copying results.jsonl, steps.log, summary.md and logs.tgz
# (every step's log and JSON) into --out. --record also writes the summary to docs/results/hybrid-h200/summary.json
# of this checkout (on a machine whose checkout is kept; through a device call, copy --out/summary.json there).
#
# fla-core (pyproject's gpu-hybrid extra) must be importable on the GPU, and regen reads the demo config's prompt
# sets (GSM8K train, Code Alpaca, Alpaca seed tasks) from $DRAFTER_DATA_DIR, the cache or the hub: installed / set,
# or carried by --bundle (benchmarks/offline_bundle.sh pack --out .bundle --no-gguf --data-dir "$DRAFTER_DATA_DIR"
# --data gsm8k_train.jsonl,code_alpaca_2k.json,alpaca_seed_tasks.jsonl; parts over several calls).
# --tokenizer DIR tokenizes regen's prompts with that tokenizer (e.g. SmolLM2's, as for speed_gpu.sh: its ids fit the
# 27B shape's vocabulary and its prompt lengths are a real BPE's; without it, the byte tokenizer, several times longer).
# REGEN_BATCHES=64,128 sets regen's batch sizes (default 64,256 over 512 prompts, `generate` over 256, on a card of
# >= 100 GB; else 16,32 over 128 and 64: 64 ran out of memory on an 80 GB card). On a card smaller than online
# training's memory before activations (`drafter plan`'s train memory for configs/qwen3.6-27b.yaml online: 85 GB),
# train and trainmax are left out with a line saying so.
# PYTHON=... picks the interpreter. Exit status 0 unless the arguments or the bundle are wrong.
set -uo pipefail
export PYTHONUNBUFFERED=1 DRAFTER_NO_PROGRESS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
BUNDLE="" OUT="" WORK="/tmp/hybrid-gpu" BUDGET_S=560 SMOKE="" RECORD="" TOKENIZER="" RETRY=() SKIP=() FIRST=()
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) BUNDLE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    --budget-s) BUDGET_S="$2"; shift 2 ;;
    --cpu-smoke) SMOKE=1; shift ;;
    --record) RECORD=1; shift ;;
    --tokenizer) TOKENIZER="$2"; shift 2 ;;
    --retry) RETRY+=("$2"); shift 2 ;;
    --skip) SKIP+=("$2"); shift 2 ;;
    --first) IFS=, read -ra FIRST <<< "$2"; shift 2 ;;
    *) echo "hybrid_gpu.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
STEPS=(env tests regen round commit extract train trainmax)
[ -n "$OUT" ] || { echo "hybrid_gpu.sh: --out DIR is required" >&2; exit 2; }
source benchmarks/gpu_steps.sh  # begin_steps, left, log, step, timeboxed
check_tokenizer hybrid_gpu.sh
begin_steps hybrid_gpu.sh
finish() {
  "$PY" benchmarks/hybrid_gpu_summary.py --work "$WORK" --out "$OUT/summary.json" \
    ${RECORD:+--record docs/results/hybrid-h200/summary.json} >> "$WORK/steps.log" 2>&1
  cp "$WORK/results.jsonl" "$WORK/steps.log" "$OUT/" 2>/dev/null
  [ -f "$WORK/summary.md" ] && cp "$WORK/summary.md" "$OUT/"
  tar -czf "$OUT/logs.tgz" -C "$WORK" logs json 2>/dev/null
  log "call ends; done: $(cd "$WORK" && ls done.* 2>/dev/null | sed 's/done\.//' | tr '\n' ' ')"
}
trap finish EXIT

if [ -n "$SMOKE" ]; then  # here: the checkout's environment, toy sizes, the CPU
  DEVICE=cpu; export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  : "${DRAFTER_DATA_DIR:?--cpu-smoke: regen reads the prompt mirror, set DRAFTER_DATA_DIR}"
  SHAPE=tiny TRAIN_SHAPE=tiny-hybrid
  REGEN_ARGS=(--dtype float32 --num-prompts 8 --max-new-tokens 8 --batch-size 4,8 --modes generate,static-nograph
              --threads 1)
  ROUND_ARGS=(--cache static --past 32 --budgets 4,16 --iters 1 --ar-tokens 3)
  COMMIT_RUN=(env TRITON_INTERPRET=1 "$PY" benchmarks/bench_gdn_commit.py --shape tiny --iters 1 --nodes 40
              --configs 8x1,16x2)  # Triton's interpreter
  EXTRACT_ARGS=(--extract-tokens 4000)
  TRAIN_ARGS=(--variants trainer-dense-online-row2 --seqs 2 --steps 1 --warmup 0 --engine torch)
  MAX_ARGS=(--max-batch trainer-dense-online --max-batch-limit 2 --engine torch --timeout 300)
else
  DEVICE=cuda
  if [ -n "$BUNDLE" ]; then
    got="$(bash benchmarks/offline_bundle.sh receive --from "$BUNDLE" --to "$WORK/bundle")" || { log "bundle: $got"; exit 1; }
    log "bundle: $got"
    [ "$got" = "ready" ] || exit 0  # the next call brings the next part
    export PYTHONPATH="$WORK/bundle/site:$PYTHONPATH"
    [ -d "$WORK/bundle/data" ] && export DRAFTER_DATA_DIR="$WORK/bundle/data"
  fi
  SHAPE=qwen3.6-27b TRAIN_SHAPE=qwen3.6-27b
  # batch 256 needs the H200's memory: 54 GB of weights + 144 MiB of fp32 states per row + K/V; an 80 GB card
  # (the device tool may lend an H100 for an H200) takes 16 and 32, over fewer prompts (there, `generate` at batch
  # 16 had not finished 256 prompts x 256 tokens after 300 s)
  mem_mib="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)"
  if [ "${mem_mib:-0}" -ge 100000 ]; then regen_batches=64,256 regen_prompts=512 generate_prompts=256
  else regen_batches=16,32 regen_prompts=128 generate_prompts=64; fi
  # online training holds the whole target and the drafter's training state before any activation (drafter plan's
  # train memory); where that and 5 % for a micro-batch's activations pass what torch can allocate on this card,
  # train and trainmax cannot fit and are left out of this --work (--retry still runs them)
  why="$("$PY" -c 'import torch; from drafter.plan import estimate; from pipeline.config import load_config
need = estimate(load_config("configs/qwen3.6-27b.yaml", ["train.online=true"]))["train_memory"]["online"]
total = torch.cuda.get_device_properties(0).total_memory
if total < 1.05 * need:
    print(f"online training holds {need / 1e9:.1f} GB per GPU before activations (drafter plan), this card "
          f"{total / 1e9:.1f} GB")' 2>/dev/null)"
  if [ -n "$why" ]; then
    for s in train trainmax; do
      [[ " ${RETRY[*]} " == *" $s "* ]] && continue
      [ -f "$WORK/done.$s" ] || { leave_out "$s"; log "skip $s: $why"; }
    done
  fi
  REGEN_ARGS=(--dtype bfloat16 --num-prompts $regen_prompts --max-new-tokens 256
              --batch-size "${REGEN_BATCHES:-$regen_batches}" --modes generate,static --generate-prompts $generate_prompts
              --profile)  # (the static rows' middle batch again under the profiler: where the step's time goes)
  [ -n "$TOKENIZER" ] && REGEN_ARGS+=(--tokenizer "$TOKENIZER")
  ROUND_ARGS=(--cache graphs --past 1024 --budgets 16,64,256 --iters 10 --profile-overhead)
  COMMIT_RUN=("$PY" benchmarks/bench_gdn_commit.py --shape qwen3.6-27b)
  EXTRACT_ARGS=(--extract-tokens 100000 --profile-extract)
  TRAIN_ARGS=(--variants qwen3.6-27b --steps 3 --warmup 2 --timeout 400)
  MAX_ARGS=(--max-batch trainer-flex-compile-ac-online --max-batch-limit 32 --timeout 240)
fi


step_env() {
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"; }
  "$PY" - "$DEVICE" <<'PY'
import platform, sys, torch, transformers
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__)
try:
    import fla, fla.ops.gated_delta_rule  # noqa: F401
    print("fla-core", fla.__version__)
except ImportError as e:
    print("fla-core not importable:", e)
    if sys.argv[1] == "cuda":
        sys.exit("the Gated-DeltaNet kernels need fla-core on the GPU: install the gpu-hybrid extra or pass --bundle")
PY
}

# the kernel-equality tests first (quick, and what the extract step's numbers rest on), then the slower decode ones
TEST_FILES=(tests/pipeline/test_target_kernels.py tests/extract/test_hf.py tests/eval/test_tree_recurrent.py
            tests/eval/test_tree_recurrent_triton.py tests/eval/test_hybrid_cache.py tests/eval/test_decode_greedy.py
            tests/pipeline/test_regen_static_hybrid.py)
step_tests() {
  if [ -n "$SMOKE" ]; then  # CUDA-only tests skip on the CPU: prove the selection names tests
    timeboxed "$PY" -m pytest -q -p no:cacheprovider --collect-only "${TEST_FILES[@]}" -k "cuda or fla_kernels"
    return $?
  fi
  timeboxed "$PY" -m pytest -q -p no:cacheprovider --tb=short "${TEST_FILES[@]}" -k "cuda or fla_kernels"
}

step_regen() {
  timeboxed "$PY" benchmarks/bench_regen.py --shape $SHAPE --device $DEVICE "${REGEN_ARGS[@]}" --json "$WORK/json/regen.json"
}

step_round() {
  timeboxed "$PY" benchmarks/bench_hybrid.py --device $DEVICE --shape $SHAPE --sections verify,reference \
    "${ROUND_ARGS[@]}" --out "$WORK/round"
  local rc=$?; cp "$WORK/round/summary.json" "$WORK/json/round.json" 2>/dev/null; return $rc
}

step_commit() {
  timeboxed "${COMMIT_RUN[@]}" --device $DEVICE --json "$WORK/json/commit.json"
}

step_extract() {
  timeboxed "$PY" benchmarks/bench_hybrid.py --device $DEVICE --shape $SHAPE --sections extract "${EXTRACT_ARGS[@]}" \
    --work-dir "$WORK/extract-shards" --out "$WORK/extract"
  local rc=$?; cp "$WORK/extract/summary.json" "$WORK/json/extract.json" 2>/dev/null; return $rc
}

step_train() {
  timeboxed "$PY" benchmarks/bench_train.py --device $DEVICE --shape $TRAIN_SHAPE "${TRAIN_ARGS[@]}" \
    --json "$WORK/json/train.json"
}

step_trainmax() {  # each trial is a fresh process; the log keeps every trial's line if the call's time runs out
  timeboxed "$PY" benchmarks/bench_train.py --device $DEVICE --shape $TRAIN_SHAPE --variants none "${MAX_ARGS[@]}" \
    --json "$WORK/json/trainmax.json"
}

step env 30
[ -z "$SMOKE" ] && [ "$(cat "$WORK/done.env" 2>/dev/null)" != 0 ] && { log "env failed: nothing else runs"; exit 0; }
run_steps tests:330 regen:400 round:120 commit:90 extract:240 train:450 trainmax:300
[ -f "$WORK/done.trainmax" ] && log "all steps done"
exit 0
