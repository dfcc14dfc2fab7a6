# Sourced by the GPU recipe scripts (vllm_gpu.sh, hybrid_gpu.sh): the step runner they share.
# A device call runs under a time budget and its machine is gone afterwards, so a recipe is a list of steps, each
# run once per --work directory (a done.NAME marker holds its exit code; --retry removes it), skipped with a line
# when the call has too little time left, and logged to logs/NAME.log, results.jsonl and summary.md.
# The caller sets WORK, T0, DEADLINE and DEVICE (or calls begin_steps) and defines step_NAME for each step.

left() { echo $(( DEADLINE - $(date +%s) )); }
log() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$WORK/steps.log"; }

step() {  # NAME MIN_SECONDS: run the function step_NAME once, logging to logs/NAME.log
  local name=$1 need=$2
  [ -f "$WORK/done.$name" ] && return 0
  if [ "$(left)" -lt "$need" ]; then log "skip $name: $(left) s left, it needs ~$need"; return 0; fi
  log "step $name ($(left) s left)"
  local t rc; t=$(date +%s)
  ( "step_$name" ) > "$WORK/logs/$name.log" 2>&1; rc=$?
  local dt=$(( $(date +%s) - t ))
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $dt, \"device\": \"$DEVICE\"}" >> "$WORK/results.jsonl"
  echo "$rc" > "$WORK/done.$name"
  log "$name rc=$rc in ${dt}s"; tail -n 25 "$WORK/logs/$name.log" | cut -c1-300
  # the summary keeps the step's own lines: engine logs (vLLM's INFO/WARNING, ranks' prefixes) and bars left out
  { echo "## $name (rc $rc, ${dt} s)"; echo '```'; grep -v -E "^(INFO|WARNING|DEBUG|\(|\[rank)" "$WORK/logs/$name.log" \
      | grep -v -E "^\s*$|it/s\]|Warning|warn\(" | tail -n 40 | cut -c1-400; echo '```'; } >> "$WORK/summary.md"
}

run_steps() {  # NAME:MIN_SECONDS ...: step each in this order, those named by --first (FIRST) ahead of the rest
  local s n order=(); local -A need=()
  for s in "$@"; do need[${s%%:*}]=${s##*:}; done
  for n in "${FIRST[@]}"; do [ -n "${need[$n]:-}" ] && order+=("$n"); done
  for s in "$@"; do n=${s%%:*}; [[ " ${FIRST[*]} " == *" $n "* ]] || order+=("$n"); done
  for n in "${order[@]}"; do step "$n" "${need[$n]}"; done
}

leave_out() {  # NAME: mark a step as not run in this --work (no results line: a summary names it missing)
  [ -f "$WORK/done.$1" ] || echo skipped > "$WORK/done.$1"
}

check_tokenizer() {  # SCRIPT: a --tokenizer DIR must hold tokenizer.json; TOKENIZER becomes its absolute path
  [ -n "$TOKENIZER" ] || return 0
  [ -f "$TOKENIZER/tokenizer.json" ] || { echo "$1: --tokenizer $TOKENIZER has no tokenizer.json" >&2; exit 2; }
  TOKENIZER="$(cd "$TOKENIZER" && pwd)"
}

timeboxed() { timeout -k 15 $(( $(left) - 10 )) "$@"; }  # a command that must end before the call's budget does

begin_steps() {  # SCRIPT: check --retry / --skip / --first against STEPS, start the call's clock, make WORK and OUT, apply them
  # (uses STEPS, RETRY, SKIP, FIRST, WORK, OUT, BUDGET_S; sets T0, DEADLINE and OUT as an absolute path)
  local s
  for s in "${RETRY[@]}" "${SKIP[@]}" "${FIRST[@]}"; do
    [[ " ${STEPS[*]} " == *" $s "* ]] || { echo "$1: no such step: $s (${STEPS[*]})" >&2; exit 2; }
  done
  T0=$(date +%s); DEADLINE=$((T0 + BUDGET_S))
  mkdir -p "$WORK/logs" "$WORK/json" "$OUT"; OUT="$(cd "$OUT" && pwd)"
  touch "$WORK/results.jsonl"
  for s in "${RETRY[@]}"; do rm -f "$WORK/done.$s"; done
  for s in "${SKIP[@]}"; do  # left out of this --work (no results line: a summary names it missing)
    leave_out "$s"
  done
}
