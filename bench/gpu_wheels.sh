#!/usr/bin/env bash
# The optional GPU kernels for a GPU machine that has torch but no package index, from wheels fetched on a machine
# that has one: FlashAttention-4 (flash-attn-4 and the CuTe DSL; the attention) and fla-core 0.6 with Triton 3.7.1
# (the Gated DeltaNet of Qwen3.5; fla refuses Triton < 3.7.1 on Hopper). Python 3.12, x86-64 Linux, CUDA 13.
#
#   bash bench/gpu_wheels.sh download   # here: unpack every wheel into one tree, pack it as tar.xz (168 MB, from
#                                       # 1 GB), cut it in three: .whl/p1 ... .whl/p3 (54 MiB each: a call
#                                       # carries 64 MiB, the working tree included)
#   bash bench/gpu_wheels.sh download fla   # fla, Triton 3.7.1 and torchao only (no FA4: attention on cuDNN, which
#                                       # an H100 takes anyway), in two parts: .whl/f1, .whl/f2
#   bash bench/gpu_wheels.sh stage      # there, in calls that carry .whl/p1, then p2 (or f1): copy to /tmp/gpu_wheels
#   bash bench/gpu_wheels.sh install    # there, in the next call, carrying .whl/p3 (or f2): join, unpack into /tmp/site
#   export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
#
# Wheels are unpacked (python3 -m zipfile -e), not pip-installed: no resolver, nothing of the image's own packages
# is touched (the Triton here shadows torch's own only through PYTHONPATH), and the cutlass DSL's .pth file (which
# puts dsl_packages on sys.path) is replaced by PYTHONPATH. Triton's profiler parts (cupti, proton) and its
# Blackwell ptxas are left out: nothing here uses them, and they would need another call. On a machine with an
# index: pip install flash-attn-4 fla-core==0.6.0 triton==3.7.1.
set -euo pipefail
WHEELS=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
        nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 "apache-tvm-ffi<0.2"
        torch-c-dlpack-ext quack-kernels triton==3.7.1 fla-core==0.6.0 einops)
STAGE=/tmp/gpu_wheels
P=p; N=3
if [ "${2:-}" = fla ]; then WHEELS=(triton==3.7.1 fla-core==0.6.0 einops torchao==0.18.0); P=f; N=2; fi

case "${1:-}" in
download)
    rm -rf .whl/all .whl/site .whl/$P? && mkdir -p .whl/all .whl/site && for i in $(seq $N); do mkdir .whl/$P$i; done
    for w in "${WHEELS[@]}"; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/all "$w"
    done
    for f in .whl/all/*.whl; do python3 -m zipfile -e "$f" .whl/site; done
    rm -rf .whl/site/*.pth .whl/site/triton/backends/nvidia/lib/cupti .whl/site/triton/_C/libproton.so \
        .whl/site/triton/instrumentation .whl/site/triton/backends/nvidia/bin/ptxas-blackwell
    tar -cf - -C .whl site | xz -T0 -6 > .whl/site.tar.xz
    split -n $N .whl/site.tar.xz .whl/site.tar.xz.part
    i=1; for part in .whl/site.tar.xz.parta?; do mv "$part" ".whl/$P$i/"; i=$((i + 1)); done
    rm -rf .whl/site .whl/site.tar.xz
    du -sh .whl/$P?
    ;;
stage)
    mkdir -p $STAGE && cp .whl/[pf]?/* $STAGE/ && ls $STAGE
    ;;
install)
    cp .whl/[pf]?/* $STAGE/
    cat $STAGE/site.tar.xz.parta? | tar -xJf - -C /tmp
    chmod +x /tmp/site/triton/backends/nvidia/bin/*          # zipfile -e drops the mode bits: ptxas must run
    rm -rf $STAGE
    PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages python3 -c "import triton, fla.ops.gated_delta_rule
try:
    import flash_attn.cute, cutlass; print('flash_attn.cute', cutlass.__version__)
except ImportError: print('no FA4: attention on cuDNN')
print('triton', triton.__version__)"
    ;;
*)
    echo "usage: bash bench/gpu_wheels.sh download [fla]|stage|install" >&2
    exit 2
    ;;
esac
