#!/usr/bin/env bash
# One prepared call for a lent GPU machine (torch, nvcc, cmake, pybind11, scikit-build-core
# there; no sglang, no network): build the CUDA variant, check the kernels and the layer
# pipeline against the CPU reference on random inputs, and time them; profile Llama-shaped
# layers for the simulator's device model. Fits in 8 minutes.
# Usage there: bash benchmark/gpu_check.sh   (writes a copy of its output to $OUT if set)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${OUT:-/tmp}/gpu_check.log
export PYTHONUNBUFFERED=1
exec > >(tee "$LOG") 2>&1

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

echo "== build (BANASERVE_CUDA=ON, sm_90)"
start=$(date +%s)
BANASERVE_CUDA=ON $PY -m pip install -q --no-deps --no-build-isolation --target /tmp/bs-gpu . \
  || { echo "build FAILED"; exit 1; }
echo "built in $(( $(date +%s) - start )) s"
export PYTHONPATH=/tmp/bs-gpu
$PY -c "from banaserve import _C; assert _C.cuda_compiled(); print('devices', _C.cuda_device_count())" \
  || exit 1

status=0
echo "== unit tests on the device (CUDA cases run here, skip elsewhere)"
timeout 120 $PY -m pytest -q -p no:cacheprovider test/unit/test_extension.py test/unit/test_attention.py \
  test/unit/test_pipeline.py test/unit/test_layer_store.py || status=1

echo "== attention: CUDA vs CPU kernels, timings, merge vs copy bandwidth"
timeout 90 $PY benchmark/attention_gpu_check.py || status=1

echo "== split decode attention: flash partials merged by log-sum-exp against the whole"
timeout 60 $PY benchmark/attention_split_gpu_check.py || status=1

echo "== attention offload to the host: one round trip per layer, host attention against the GPU's"
timeout 200 $PY benchmark/offload_roundtrip_gpu_check.py || status=1

echo "== layer pipeline on CUDA streams"
timeout 60 $PY benchmark/pipeline_gpu_check.py || status=1

echo "== layer profile for the simulator (Llama-3 8B and 70B layer shapes, bf16, plain PyTorch)"
timeout 240 $PY benchmark/gpu_layer_profile.py --out "${OUT:-/tmp}/gpu_layer_profile.json" || status=1

echo "== gpu_check: $([ $status = 0 ] && echo OK || echo FAIL)"
exit $status
