#!/usr/bin/env bash
# LoRA, QLoRA and the retrieval test on one GPU: Qwen3-8B (random init), FA4, --fit auto, LoRA rank 16 on every
# linear of attention and MLP. One stage per call; each run has its own timeout and its files land in OUT.
#
#   bash bench/lora_gpu.sh tests OUT       # the GPU tests (pytest -m gpu tests)
#   bash bench/lora_gpu.sh 131k OUT        # one LoRA projection's forms (bench/lora_linear.py), then LoRA (3 steps,
#                                          # the 2nd and 3rd timed) and QLoRA (2 steps) at 131,072 tokens
#   bash bench/lora_gpu.sh lora131k OUT   # LoRA alone at 131,072 tokens (3 steps)
#   bash bench/lora_gpu.sh kept131k OUT   # bench/lora_linear.py, then LoRA at 131,072 tokens (3 steps); if it
#                                          # fails, again with --keep_mlp_layers 8 (2 steps)
#   bash bench/lora_gpu.sh qlora131k OUT  # QLoRA alone at 131,072 tokens (2 steps)
#   bash bench/lora_gpu.sh retrieval OUT   # bench/retrieval_cost.py at 131,072 tokens
#   bash bench/lora_gpu.sh longest80 OUT   # LoRA at 393,216 tokens planned for an 80 GB GPU (--gpu_mem_gib 74.5)
#   bash bench/lora_gpu.sh longest OUT     # LoRA at 524,288 tokens on the whole GPU: one step is longer than a
#                                          # 10-minute call, so it starts under setsid and waits up to 560 s;
#   bash bench/lora_gpu.sh collect OUT     # ... then this waits (up to 570 s) for it to end and collects its files
#   bash bench/lora_gpu.sh profile OUT     # LoRA at 131,072 tokens, the levers --fit auto picks there given by hand
#                                          # (bench/profile_step.py runs --fit off): step 3 traced, its summary
#
# FA4 on PYTHONPATH first (bench/gpu_wheels.sh); QLoRA needs torchao, the tests need peft (wheels, --no-deps).
set -u
STAGE=$1; OUT=$(mkdir -p "$2" && cd "$2" && pwd)
MODEL=bench/configs/qwen3-8b
COMMON="--model $MODEL --tokenizer byte --data synthetic --checkpoints false --resume none --overwrite true"

# Each run starts in a process group of its own (setsid), whose id goes into $GROUPS_FILE: a run cut by its
# timeout can leave workers holding the GPU, and only the groups this script started are ended, never a process
# that merely matches a name.
GROUPS_FILE=/tmp/lora_gpu_groups
LONGEST_PID=/tmp/lora_gpu_longest.pid

clean_gpu() {
    if [ -f "$GROUPS_FILE" ]; then
        while read -r group; do kill -- "-$group" 2>/dev/null; done < "$GROUPS_FILE"
        : > "$GROUPS_FILE"; sleep 2
    fi
    nvidia-smi --query-gpu=memory.used --format=csv,noheader >> "$OUT/nvidia_smi.txt"
}

alive() {  # pid: is that process (the longest run's group leader) still running?
    [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

run() {  # name timeout flags...: one train.py run, its log and metrics into OUT
    local name=$1 limit=$2; shift 2
    clean_gpu
    setsid timeout "$limit" python -m torch.distributed.run --standalone --nproc_per_node 1 train.py $COMMON \
        --out_dir "/tmp/lora_gpu_$name" "$@" > "$OUT/$name.log" 2>&1 &
    local pid=$!
    echo "$pid" >> "$GROUPS_FILE"
    wait "$pid"
    echo "$name rc $?" >> "$OUT/rc.txt"
    cp "/tmp/lora_gpu_$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
    grep -E "^(fit|plan|step|error)" "$OUT/$name.log" | tail -6
}

wait_longest() {  # seconds: wait for the setsid run of `longest` to end, or for that long; copy what it wrote
    local t=0
    while alive "$LONGEST_PID" && [ "$t" -lt "$1" ]; do sleep 10; t=$((t + 10)); done
    alive "$LONGEST_PID" && echo "still running after ${t} s" || echo "ended"
    cp /tmp/lora_gpu_longest.log "$OUT/lora_524k.log"
    cp /tmp/lora_gpu_longest/metrics.jsonl "$OUT/lora_524k.metrics.jsonl" 2>/dev/null
    grep -E "^(fit|plan|step|error)" "$OUT/lora_524k.log" | tail -6; nvidia-smi --query-gpu=memory.used --format=csv
}

case "$STAGE" in
tests)
    timeout 420 python -m pytest -m gpu tests -q -x -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    echo "tests rc $?" >> "$OUT/rc.txt"; tail -15 "$OUT/gpu_tests.log"
    ;;
131k)
    timeout 120 python bench/lora_linear.py --tokens 131072 --out "$OUT/lora_linear.json" > "$OUT/lora_linear.log" 2>&1
    echo "lora_linear rc $?" >> "$OUT/rc.txt"; cat "$OUT/lora_linear.log"
    run lora_131k 300 --seq_len 131072 --max_steps 3 --lora_rank 16
    run qlora_131k 280 --seq_len 131072 --max_steps 2 --lora_rank 16 --quantize nf4
    ;;
lora131k)
    run lora_131k 300 --seq_len 131072 --max_steps 3 --lora_rank 16
    ;;
kept131k)  # the adapter forms, then LoRA at 131k as --fit auto plans it (kept MLP outputs in the GPU memory left),
    # and, if that run fails, with 8 blocks keeping them
    timeout 100 python bench/lora_linear.py --tokens 131072 --out "$OUT/lora_linear.json" > "$OUT/lora_linear.log" 2>&1
    echo "lora_linear rc $?" >> "$OUT/rc.txt"; cat "$OUT/lora_linear.log"
    run lora_131k 300 --seq_len 131072 --max_steps 3 --lora_rank 16
    grep -q "lora_131k rc 0" "$OUT/rc.txt" || run lora_131k_keep8 200 --seq_len 131072 --max_steps 2 --lora_rank 16 \
        --keep_mlp_layers 8
    ;;
qlora131k)
    run qlora_131k 280 --seq_len 131072 --max_steps 2 --lora_rank 16 --quantize nf4
    ;;
retrieval)
    clean_gpu
    setsid timeout 400 python -m torch.distributed.run --standalone --nproc_per_node 1 bench/retrieval_cost.py \
        --model $MODEL --tokenizer byte --data synthetic --seq_len 131072 --out "$OUT/retrieval_cost_8b_131k.json" \
        > "$OUT/retrieval_cost.log" 2>&1 &
    echo "$!" >> "$GROUPS_FILE"; wait "$!"
    echo "retrieval rc $?" >> "$OUT/rc.txt"; tail -3 "$OUT/retrieval_cost.log"
    ;;
longest80)
    run lora_393k_80gb 570 --seq_len 393216 --max_steps 1 --lora_rank 16 --gpu_mem_gib 74.5
    ;;
longest)
    clean_gpu
    setsid nohup timeout 1500 python -m torch.distributed.run --standalone --nproc_per_node 1 train.py $COMMON \
        --out_dir /tmp/lora_gpu_longest --seq_len 524288 --max_steps 1 --lora_rank 16 \
        > /tmp/lora_gpu_longest.log 2>&1 < /dev/null &
    echo "$!" > "$LONGEST_PID"; echo "$!" >> "$GROUPS_FILE"  # collect (a later call) waits for it by this id
    wait_longest 560
    ;;
collect)
    wait_longest 570
    ;;
profile)
    clean_gpu
    timeout 560 python bench/profile_step.py --run qwen3-8b:131072 --timeout 540 --extra "--lora_rank 16 \
        --attn_backend fa4 --param_dtype float32 --offload true --offload_layers 36 --keep_attention true \
        --keep_attention_layers 36" > "$OUT/profile_lora_131k.log" 2>&1
    echo "profile rc $?" >> "$OUT/rc.txt"
    cp /tmp/profile_runs/qwen3-8b_131072_*/profile/summary.json "$OUT/profile_lora_8b_131k.json" 2>/dev/null
    tail -45 "$OUT/profile_lora_131k.log"
    ;;
*)
    echo "usage: bash bench/lora_gpu.sh tests|131k|lora131k|kept131k|qlora131k|retrieval|longest80|longest|collect|profile OUT" >&2; exit 2 ;;
esac
