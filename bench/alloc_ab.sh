#!/usr/bin/env bash
# PyTorch's allocator with fixed segments (PYTORCH_CUDA_ALLOC_CONF empty: what every run before 2026-12-07 got, as
# train.py set the variable after `import torch` had read it) against the pages train.py now asks for
# (expandable_segments:True): Qwen3-1.7B's full fine-tune at 131,072 tokens, every block offloaded and keeping
# attention, 3 steps each, one after the other. Prints each run's allocated and reserved peaks and step times.
#
#   bash bench/alloc_ab.sh OUT
set -u
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
python -c "import train, torch; torch.zeros(1, device='cuda')
print('expandable segments:', torch.cuda.memory._snapshot()['allocator_settings']['expandable_segments'])"
for name in fixed pages; do
    if [ $name = fixed ]; then export PYTORCH_CUDA_ALLOC_CONF=; else unset PYTORCH_CUDA_ALLOC_CONF; fi
    setsid timeout "${TIMEOUT:-170}" python -m torch.distributed.run --standalone --nproc_per_node 1 train.py \
        --model bench/configs/qwen3-1.7b --tokenizer byte --data synthetic --seq_len 131072 --max_steps 3 \
        --param_dtype bfloat16 --fit off --checkpoints false --resume none --overwrite true \
        --out_dir "/tmp/alloc_$name" > "$OUT/$name.log" 2>&1
    echo "$name rc $?"
    cp "/tmp/alloc_$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
done
python3 - "$OUT" <<'PY'
import json, os, sys
for name in ("fixed", "pages"):
    f = os.path.join(sys.argv[1], f"{name}.metrics.jsonl")
    for r in ([json.loads(x) for x in open(f)] if os.path.exists(f) else []):
        print(f"{name} step {r['step']}: {r['step_time_s']:.2f} s, allocated {r['peak_mem_gib']:.2f} GiB, "
              f"reserved {r['reserved_gib']:.2f} GiB, outside {r['outside_gib']:.2f} GiB")
PY
