#!/usr/bin/env bash
# The extra packages of bench/reference_trl.py (the TRL recipe it compares train.py with), for a GPU machine that
# has torch, transformers 5.17 and accelerate 1.15 but no package index and no trl, datasets, dill or
# multiprocess. Pure-Python wheels (~1.8 MB), fetched on a machine that has an index. Python 3.12, any Linux.
#
#   bash bench/trl_wheels.sh download     # here: the four wheels into .whl/trl (git-ignored)
#   bash bench/trl_wheels.sh install      # there, in a call that carries .whl/trl: into /tmp/trlsite, then
#   export PYTHONPATH=/tmp/trlsite:$PYTHONPATH
#
# --no-deps: nothing of the image's own packages is touched. What these wheels require besides each other
# (pyarrow>=24, fsspec<=2026.9.0, huggingface-hub>=1.31, pandas, xxhash, tqdm, jinja2, psutil, pyyaml, ...) is
# expected on the machine; `install` prints the versions found. On a machine with an index:
#   pip install trl==1.16.0 datasets==5.2.0 accelerate==1.15.0
set -euo pipefail
WHEELS=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
DIR=.whl/trl
SITE=/tmp/trlsite

case "${1:-}" in
download)
    mkdir -p $DIR
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d $DIR "${WHEELS[@]}"
    for w in $DIR/*.whl; do
        echo "$(basename "$w"): $(unzip -p "$w" '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' \
            | sed 's/Requires-Dist: //' | tr '\n' ' ')"
    done
    du -sh $DIR
    ;;
install)
    ls $DIR/*.whl > /dev/null || { echo "no wheels in $DIR: run 'bash bench/trl_wheels.sh download' and carry $DIR" >&2; exit 2; }
    rm -rf $SITE
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE $DIR/*.whl
    PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} python3 -c "
import importlib.metadata as md
import trl, datasets, accelerate, transformers, torch
print('installed in $SITE:', ', '.join(f'{m} {md.version(m)}' for m in ('trl', 'datasets', 'dill', 'multiprocess')))
print('found:', ', '.join(f'{m} {md.version(m)}' for m in ('torch', 'transformers', 'accelerate', 'pyarrow', 'fsspec', 'huggingface-hub')))
"
    ;;
*)
    echo "usage: bash bench/trl_wheels.sh download|install" >&2
    exit 2
    ;;
esac
