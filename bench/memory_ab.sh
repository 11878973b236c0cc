#!/usr/bin/env bash
# Three memory fixes of 2026-12-07, measured against the code before them, side by side on one GPU (peaks are per
# process, so the two runs may share the card):
#   - FSDP2's root (embedding, head) gathered for the forward only, not held through the backward (parallel.py);
#   - the recomputed block's output freed before its backward runs (model.py, _RecomputedBlock);
#   - cos and sin made in the activations' dtype, one pair for every block, not an fp32 pair that FSDP2's input
#     cast copies for each block (model.py, million/qwen3_5.py).
# "before" is a copy of the working tree in /tmp/before with the three reverted by sed (checked: the script stops
# if a sed finds nothing to change).
#
#   bash bench/memory_ab.sh OUT MODEL TOKENS [train.py flags...]
#   bash bench/memory_ab.sh /tmp/ab bench/configs/qwen3-8b 65536 --lora_rank 16
#
# Each run: one step, --fit off (every block recomputed and offloaded, keeping attention), synthetic data. Prints
# each run's peak and their difference.
set -u
OUT=$(mkdir -p "$1" && cd "$1" && pwd); MODEL=$2; TOKENS=$3; shift 3
if [ -e "$MODEL" ]; then MODEL=$(cd "$MODEL" && pwd); fi  # a folder: absolute, for the copy's run too
rm -rf /tmp/before && mkdir -p /tmp/before && cp -r ./*.py million bench examples /tmp/before/
revert() {  # FILE SED: apply SED to /tmp/before/FILE, which must change it
    cp "/tmp/before/$1" /tmp/before/orig && sed -i "$2" "/tmp/before/$1"
    if cmp -s "/tmp/before/$1" /tmp/before/orig; then echo "memory_ab: nothing to revert in $1 ($2)" >&2; exit 2; fi
}
revert parallel.py 's/reshard_after_forward=True)/reshard_after_forward=False)/; /set_unshard_in_backward(False)/d'
revert model.py '/y.untyped_storage().resize_(0)/d'
revert model.py 's/rope_inv_freq(self.cfg), x.dtype)/rope_inv_freq(self.cfg), torch.float32)/'
revert million/qwen3_5.py 's/rope_inv_freq(rope), x.dtype)/rope_inv_freq(rope), torch.float32)/'

run() {  # NAME DIR: one step in DIR, its log and metrics into OUT
    (cd "$2" && setsid timeout "${TIMEOUT:-400}" python -m torch.distributed.run --standalone --nproc_per_node 1 \
        --master_port "$3" train.py --model "$MODEL" --tokenizer byte --yarn_factor 0 --data synthetic \
        --seq_len "$TOKENS" --max_steps 1 --fit off --checkpoints false --resume none --overwrite true \
        --out_dir "/tmp/ab_$1" "${@:4}" \
        > "$OUT/$1.log" 2>&1)
    cp "/tmp/ab_$1/metrics.jsonl" "$OUT/$1.metrics.jsonl" 2>/dev/null
}
run before /tmp/before 29517 "$@" &
run after . 29518 "$@"
wait
python3 - "$OUT" <<'EOF'
import json, os, sys
peak = {}
for name in ("before", "after"):
    path = os.path.join(sys.argv[1], f"{name}.metrics.jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    peak[name] = rows[-1]["peak_mem_gib"] if rows else None
    print(f"{name:7s} peak {peak[name]} GiB"
          + (f", {rows[-1]['step_time_s']:.2f} s" if rows else ": no step, see its log"))
if None not in peak.values():
    print(f"after - before: {peak['after'] - peak['before']:+.2f} GiB")
EOF
