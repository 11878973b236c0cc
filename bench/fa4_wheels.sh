#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4, CuTe DSL kernels) for a GPU machine that has torch but no package index, from
# wheels fetched on a machine that has one. Python 3.12, x86-64 Linux, CUDA 13 (the cutlass DSL's cu13 libs).
#
#   bash bench/fa4_wheels.sh download     # here: the wheels into .whl/part1 (small ones + first half of the
#                                         # 92 MB cu13 libs wheel) and .whl/part2 (its second half), each < 64 MB
#   bash bench/fa4_wheels.sh stage        # there, in a call that carries .whl/part1: copy it to /tmp/fa4_wheels
#   bash bench/fa4_wheels.sh install      # there, in a call that carries .whl/part2: join the halves and unpack
#                                         # every wheel into /tmp/site
#   export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
#
# Wheels are unpacked (python3 -m zipfile -e), not pip-installed: no resolver, nothing of the image's own
# packages is touched, and the cutlass DSL's .pth file (which puts dsl_packages on sys.path) is replaced by
# PYTHONPATH. On a machine with an index, `pip install flash-attn-4` does all of this.
set -euo pipefail
WHEELS=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
        nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 "apache-tvm-ffi<0.2"
        torch-c-dlpack-ext quack-kernels)
BIG=nvidia_cutlass_dsl_libs_cu13
STAGE=/tmp/fa4_wheels

case "${1:-}" in
download)
    mkdir -p .whl/all .whl/part1 .whl/part2
    for w in "${WHEELS[@]}"; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/all "$w"
    done
    rm -f .whl/part1/* .whl/part2/*
    for f in .whl/all/*.whl; do
        case "$(basename "$f")" in $BIG-*) ;; *) cp "$f" .whl/part1/ ;; esac
    done
    big=$(ls .whl/all/$BIG-*.whl)
    split -b 46000000 "$big" ".whl/split_"
    mv .whl/split_aa ".whl/part1/$(basename "$big").partaa"
    mv .whl/split_ab ".whl/part2/$(basename "$big").partab"
    du -sh .whl/part1 .whl/part2
    ;;
stage)
    mkdir -p $STAGE && cp .whl/part1/* $STAGE/
    ;;
install)
    cp .whl/part2/* $STAGE/
    cd $STAGE
    for first in *.partaa; do cat "$first" "${first%.partaa}.partab" > "${first%.partaa}" && rm "$first" "${first%.partaa}.partab"; done
    mkdir -p /tmp/site
    for w in *.whl; do python3 -m zipfile -e "$w" /tmp/site; done
    rm -f /tmp/site/*.pth
    PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages python3 -c \
        "import flash_attn.cute, cutlass; print('flash_attn.cute', flash_attn.cute.__file__, 'cutlass', cutlass.__version__)"
    ;;
*)
    echo "usage: bash bench/fa4_wheels.sh download|stage|install" >&2
    exit 2
    ;;
esac
