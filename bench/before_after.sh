#!/usr/bin/env bash
# The code of two commits side by side on one GPU, alternating (after, before) so that a drifting clock favours
# neither: Qwen3-8B (random init, FA4, --fit auto) at 131,072 tokens, 3 steps (the 2nd and 3rd are timed; the
# 1st compiles), either the full fine-tune or LoRA rank 16. One stage per call (each takes about 6 minutes).
#
#   git archive OLD_COMMIT | tar -x -C runs/before      # here; runs/ is ignored, so carry it to the GPU machine
#   bash bench/before_after.sh full runs/before $OUT      # there, with FA4 on PYTHONPATH (bench/gpu_wheels.sh)
#   bash bench/before_after.sh lora runs/before $OUT
#   bash bench/before_after.sh docs runs/before $OUT      # each rank's document attention (bench/doc_balance.py)
#
# Each run starts in a process group of its own; a run cut by its timeout has that group ended, and nothing else.
set -u
STAGE=$1; BEFORE=$(cd "$2" && pwd); OUT=$(mkdir -p "$3" && cd "$3" && pwd); HERE=$(pwd)
tree() { if [ "$1" = after ]; then echo "$HERE"; else echo "$BEFORE"; fi; }

step() {  # tree name flags...: one train.py run in that tree, its log and metrics into OUT
    local t=$1 name=$2; shift 2
    (cd "$(tree "$t")" || exit 1
     setsid timeout 290 python -m torch.distributed.run --standalone --nproc_per_node 1 \
        train.py --model bench/configs/qwen3-8b --tokenizer byte --data synthetic --seq_len 131072 --max_steps 3 \
        --checkpoints false --resume none --overwrite true --out_dir "/tmp/before_after_${name}_$t" "$@" \
        > "$OUT/${name}_$t.log" 2>&1 &
     pid=$!; wait "$pid"; echo "${name}_$t rc $?" >> "$OUT/rc.txt"; kill -- "-$pid" 2>/dev/null
     cp "/tmp/before_after_${name}_$t/metrics.jsonl" "$OUT/${name}_$t.metrics.jsonl" 2>/dev/null)
}

case "$STAGE" in
full)
    for t in after before; do step "$t" full; done ;;
lora)
    for t in after before; do step "$t" lora --lora_rank 16; done ;;
docs)
    for t in after before; do
        (cd "$(tree $t)" && timeout 300 python bench/doc_balance.py attn --out "$OUT/doc_attn_$t.json" \
            > "$OUT/doc_attn_$t.log" 2>&1)
    done ;;
*)
    echo "usage: bash bench/before_after.sh full|lora|docs BEFORE_TREE OUT" >&2; exit 2 ;;
esac
# the table: step time of steps 2 and 3, peak memory, for each tree
python3 - "$OUT" "$STAGE" <<'PY'
import json, os, sys
out, stage = sys.argv[1:]
for t in ("after", "before"):
    f = os.path.join(out, f"{stage}_{t}.metrics.jsonl")
    rows = [json.loads(x) for x in open(f)] if os.path.exists(f) else []
    times = [r["step_time_s"] for r in rows if r["step"] >= 2]
    print(f"{stage} {t}: steps {[r['step'] for r in rows]}, timed {['%.2f' % x for x in times]} s, "
          f"mean {sum(times) / max(len(times), 1):.2f} s, peak {max([r['peak_mem_gib'] for r in rows] or [0]):.1f} GiB, "
          f"loss {[round(r['loss'], 5) for r in rows]}")
PY
