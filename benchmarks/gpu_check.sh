#!/usr/bin/env bash
# The GPU check of the CUDA kernels (sakura-quant's NF4 dequantize, sakura-offload's AdamW):
# builds them with nvcc into a fresh cache, runs their GPU tests, then times them beside
# their rivals (benchmarks/gpu_kernels.py).  Meant to finish in well under 5 minutes on one
# H200 (the tests are cut at 180 s, the timings at 100 s); the output is also written to OUTPUT_DIR (default $OUT/gpu-check if OUT is set, else
# reports/gpu-check): pytest.log, gpu_kernels.log, gpu_kernels.json.
#
#   bash benchmarks/gpu_check.sh [OUTPUT_DIR]
#
# Needs, on the GPU machine, from a plain checkout (nothing built, no virtualenv):
#   - python3 with torch built for CUDA (torch.cuda.is_available() true), pytest and pluggy;
#     bitsandbytes with CUDA is optional (timed as a rival when present);
#   - nvcc (CUDA_HOME/bin, PATH, or /usr/local/cuda/bin) and a driver that supports that
#     nvcc's CUDA version (the kernels link its runtime statically);
#   - a C++ compiler with OpenMP (the CPU kernels the tests compare against).
# The workspace packages are used from the source tree (PYTHONPATH), not installed.
# Without a CUDA device it says so and exits 0, so `nox -s bench` can run it anywhere.
set -uo pipefail

cd "$(dirname "$0")/.."
if [ -n "${1:-}" ]; then out="$1"; elif [ -n "${OUT:-}" ]; then out="$OUT/gpu-check"; else out="reports/gpu-check"; fi
mkdir -p "$out"
python="${PYTHON:-python3}"

if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA device (or no CUDA build of torch) here; nothing to check"
    exit 0
fi

# sakura-bench for its statistics (sakura_bench.measure imports no torch and nothing else of it)
export PYTHONPATH="core/src:packages/sakura-torch/src:packages/sakura-quant/src:packages/sakura-offload/src:packages/sakura-bench/src${PYTHONPATH:+:$PYTHONPATH}"
cache="$(mktemp -d)"
export SAKURA_QUANT_CACHE="$cache/quant" SAKURA_OFFLOAD_CACHE="$cache/offload"
unset SAKURA_QUANT_NO_KERNEL SAKURA_OFFLOAD_NO_KERNEL
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"

{
    echo "== $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
    "$python" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"
    command -v nvcc >/dev/null && nvcc --version | tail -2 || echo "nvcc not on PATH (CUDA_HOME=${CUDA_HOME:-unset})"
} | tee "$out/environment.log"

status=0
# -p no:cacheprovider: write nothing into the checkout; -rs lists every skip with its reason
# (a GPU test that skips here is a failure of the check, see the grep below).
timeout 180 "$python" -m pytest -c pyproject.toml --import-mode=importlib -p no:cacheprovider \
    -q -rs \
    packages/sakura-torch/tests/test_native_cuda.py \
    packages/sakura-quant/tests/test_kernel_cuda.py \
    packages/sakura-offload/tests/test_kernel_cuda.py 2>&1 | tee "$out/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if grep -q "needs a CUDA device\|nvcc is not installed" "$out/pytest.log"; then
    echo "gpu_check: GPU tests were skipped on a machine with a GPU" | tee -a "$out/pytest.log"
    status=1
fi

timeout 100 "$python" benchmarks/gpu_kernels.py --trials "${TRIALS:-7}" --json "$out/gpu_kernels.json" \
    2>&1 | tee "$out/gpu_kernels.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

rm -rf "$cache"
echo "gpu_check: $([ $status -eq 0 ] && echo passed || echo FAILED); logs in $out"
exit $status
