#!/usr/bin/env bash
# bench/cuda_check.py on a lent GPU machine in one command, from the repository root. That machine's image has
# PyTorch with CUDA, Triton and most of our dependencies but no package index, so what it lacks travels as wheels.
#
#   here:  bash bench/cuda_check.sh prepare   # wheels -> .whl/, 4-bit compressed-tensors checkpoints -> .devdata/
#          (both git-ignored through .git/info/exclude; carry them: the device tool's carry [".whl", ".devdata"])
#   there: bash bench/cuda_check.sh run       # the JSON report in $OUT/cuda_check.json, a summary on stdout
#
# run: CUDA's int4 tests (tests/test_kernels_int4_torch.py on the GPU), then bench/cuda_check.py. The CPU kernels
# (the CPU oracle's fast path) compile first, side by side; where they cannot, the oracle runs the portable path.
set -u
case "${1:-}" in
prepare)
    exclude=.git/info/exclude
    mkdir -p .git/info .whl .devdata
    for path in /.whl/ /.devdata/; do grep -qxF "$path" "$exclude" 2>/dev/null || echo "$path" >> "$exclude"; done
    for wheel in transformers==5.24.0 gguf==0.19.0 llguidance==1.9.1 flash-linear-attention==0.6.0 fla-core==0.6.0; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d .whl "$wheel" || exit 1
    done
    PYTHONPATH=.:tests .venv/bin/python - <<'EOF' || exit 1
from pathlib import Path

from tests.test_weights_compressed_tensors import make_checkpoint

# the field's layout (INT8 embedding, INT4 head), a symmetric hybrid, an asymmetric tied hybrid
for name in ("dense_w4_g32_int8embed_int4head", "hybrid_w4_g128_int8embed", "hybrid_w4_asym_g64_tied"):
    folder = Path(".devdata") / f"ct_{name}"
    folder.mkdir(parents=True, exist_ok=True)
    make_checkpoint(name, folder)
    print("made", folder)
EOF
    du -sh .whl .devdata
    ;;
run)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 3
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 DELTASERVE_KERNEL_CACHE=/tmp/deltaserve-kernels
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import sys, torch, transformers as t; print(sys.version.split()[0], torch.__version__, t.__version__)"
    timeout 240 python3 -c "
from concurrent.futures import ThreadPoolExecutor
from deltaserve.kernels.build import MODULES
with ThreadPoolExecutor(len(MODULES)) as pool:
    print('CPU kernels built:', list(pool.map(lambda m: m.load(print) is not None, MODULES)))" 2>&1 | tail -4
    timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_int4_torch.py -k cuda 2>&1 | tail -12
    timeout "${CHECK_SECONDS:-420}" python3 bench/cuda_check.py --out "${OUT:-.}" --int4-checkpoints .devdata/ct_* \
        > "${OUT:-.}/cuda_check.log" 2>&1
    echo "cuda_check.py exit $?"
    tail -c 1500 "${OUT:-.}/cuda_check.log"
    ;;
*)
    echo "usage: bash bench/cuda_check.sh prepare|run" >&2
    exit 2
    ;;
esac
