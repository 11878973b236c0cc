#!/usr/bin/env bash
# The code of two commits side by side on one GPU: each rank's document attention (bench/doc_balance.py attn) and
# the Qwen3-8B step at 131,072 tokens (random init, FA4, --fit auto, 2 steps: the second is the one timed), for an older tree and this one.
#
#   git archive OLD_COMMIT | tar -x -C runs/before        # here; runs/ is ignored, so carry it to the GPU machine
#   bash bench/before_after.sh runs/before $OUT             # there, with FA4 on PYTHONPATH (bench/fa4_wheels.sh)
#
# Runs alternate (after, before) so that a drifting clock does not favour either; files land in the second argument.
set -u
BEFORE=$(cd "$1" && pwd); OUT=$(mkdir -p "$2" && cd "$2" && pwd); HERE=$(pwd)
tree() { if [ "$1" = after ]; then echo "$HERE"; else echo "$BEFORE"; fi; }
for t in after before; do
    (cd "$(tree $t)" && timeout 300 python bench/doc_balance.py attn --out "$OUT/doc_attn_$t.json" \
        > "$OUT/doc_attn_$t.log" 2>&1)
done
for t in after before; do
    (cd "$(tree $t)" && timeout 420 python -m torch.distributed.run --standalone --nproc_per_node 1 train.py \
        --model bench/configs/qwen3-8b --tokenizer byte --data synthetic --seq_len 131072 --max_steps 2 \
        --checkpoints false --resume none --overwrite true --out_dir "/tmp/before_after_$t" > "$OUT/step_$t.log" 2>&1
     cp "/tmp/before_after_$t/metrics.jsonl" "$OUT/metrics_$t.jsonl")
done
echo done > "$OUT/DONE"
