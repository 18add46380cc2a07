#!/bin/bash
# The GPU tier on a machine that has torch / triton / transformers but not the project's test extra
# (the lent device's image: no lm_eval, starlette or llmcompressor, so `pytest -m gpu` over the whole
# tests/ tree fails to collect). Run from the repository root:
#
#     bash tests/gpu/device_tier.sh OUT_DIR [GIT_COMMIT]
#
# Wheels in .whl/ (llguidance: structured output, which the host-sync test uses) are installed to
# /tmp/site first. Runs tests/gpu (and the preprocessing test marked gpu) and, on a second GPU when
# there is one (else after it), the kernel tests natively (TRITON_INTERPRET=0) at their production
# branches; test_kernel_fnuz.py is left out (e4m3fnuz is AMD's format: it does not compile for
# NVIDIA). Writes OUT_DIR/gpu_tier.txt and OUT_DIR/native_kernels.txt; exits non-zero if either failed.
set -u
out=${1:?usage: device_tier.sh OUT_DIR [GIT_COMMIT]}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/runtime:$PWD/tests
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export QCOMPILE_GIT_COMMIT=${2:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
K=tests/runtime/kernels
# the kernel test files whose tensors go to the GPU when there is one (the others run on CPU tensors)
kernels=()
for name in fp8_gemm fused_moe fused_moe_w4a16 paged_attention qknorm_mrope qknorm_rope quant splitk_fold w4a16_gemm; do
    kernels+=("$K/test_kernel_$name.py")
done
native() {
    TRITON_INTERPRET=0 python3 -m pytest "${kernels[@]}" -q -p no:cacheprovider -n 4 2>&1 | tail -n 30 > "$out/native_kernels.txt"
    return "${PIPESTATUS[0]}"
}
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "# GPU tier at $QCOMPILE_GIT_COMMIT on $gpus x $(python3 -c 'import torch; print(torch.cuda.get_device_name())')" | tee "$out/gpu_tier.txt"
if [ "$gpus" -ge 2 ]; then
    # the second visible GPU (a physical id, also when CUDA_VISIBLE_DEVICES already narrows the set)
    IFS=, read -r first second _ <<< "${CUDA_VISIBLE_DEVICES:-0,1}"
    (CUDA_VISIBLE_DEVICES=$second native) &
    pid=$!
fi
python3 -m pytest -m gpu tests/gpu tests/runtime/vision/test_vision_preprocess.py -q -p no:cacheprovider 2>&1 \
    | grep -v "UserWarning\|warn(" | tail -n 60 >> "$out/gpu_tier.txt"
tier=${PIPESTATUS[0]}
if [ "$gpus" -ge 2 ]; then
    wait "$pid"
    kern=$?
else
    native
    kern=$?
fi
tail -n 3 "$out/gpu_tier.txt" "$out/native_kernels.txt"
[ "$tier" -eq 0 ] && [ "$kern" -eq 0 ]
