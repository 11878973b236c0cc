#!/usr/bin/env bash
# Qwen3.5 at the 9B shape of transformers' Qwen3_5TextConfig defaults (bench/configs/qwen3_5-9b: 8.95 B
# parameters, 24 Gated DeltaNet + 8 gated attention layers), random init, LoRA r16 on every linear (the DeltaNet
# projections included), one GPU, 2 steps; the DeltaNet layers on the pure-PyTorch chunked rule (no fla).
#
#   bash bench/qwen3_5_gpu.sh OUT [TOKENS...]     # default: 16384 65536; FA4 on PYTHONPATH if installed
#
# Each run starts in a process group of its own; a run cut by its timeout has that group ended, and nothing else.
set -u
OUT=$(mkdir -p "$1" && cd "$1" && pwd); shift
TARGETS=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj
for n in "${@:-16384 65536}"; do
    for tokens in $n; do
        setsid timeout "$(( tokens < 32768 ? 200 : 380 ))" python -m torch.distributed.run --standalone \
            --nproc_per_node 1 train.py --model bench/configs/qwen3_5-9b --tokenizer byte --data synthetic \
            --yarn_factor 0 --seq_len "$tokens" --max_steps 2 --lora_rank 16 --lora_targets "$TARGETS" \
            --checkpoints false --resume none --overwrite true --out_dir "/tmp/q35_$tokens" \
            > "$OUT/q35_$tokens.log" 2>&1 &
        pid=$!; wait "$pid"; echo "q35_$tokens rc $?" >> "$OUT/rc.txt"; kill -- "-$pid" 2>/dev/null
        cp "/tmp/q35_$tokens/metrics.jsonl" "$OUT/q35_$tokens.metrics.jsonl" 2>/dev/null
        grep -E "^(fit|model|step|error)" "$OUT/q35_$tokens.log" | tail -5
    done
done
