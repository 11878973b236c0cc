#!/usr/bin/env bash
# Qwen3.5 at the 9B shape of transformers' Qwen3_5TextConfig defaults (bench/configs/qwen3_5-9b: 8.95 B
# parameters, 24 Gated DeltaNet + 8 gated attention layers), random init, one GPU, 2 steps (the second is timed):
# LoRA r16 on every linear (the DeltaNet projections included), or a full fine-tune (bf16 weights and AdamW
# states with stochastic rounding: fp32 ones, 16 bytes a parameter, do not fit one GPU).
#
#   bash bench/qwen3_5_gpu.sh OUT RUN...      # RUN: lora:TOKENS or full:TOKENS, e.g. lora:131072 full:131072
#   EXTRA="--offload_layers 20" bash bench/qwen3_5_gpu.sh OUT lora:524288    # flags added to every run
#   MODEL=bench/configs/qwen3_5-35b-a3b bash bench/qwen3_5_gpu.sh OUT lora:131072  # Qwen3.5-MoE: LoRA on attention
#                                                                                   # and DeltaNet (experts: none)
#   TARGETS=q_proj,in_proj_qkv bash bench/qwen3_5_gpu.sh OUT lora:131072           # other --lora_targets
#                                                    # (with ,experts on the 35B-A3B: its routed experts adapted too)
#   SCRIPT=bench/capped.py CAP_GIB=50 bash bench/qwen3_5_gpu.sh OUT lora:262144      # the allocator capped
#
# With bench/gpu_wheels.sh's packages on PYTHONPATH the DeltaNet runs on fla and the attention on FA4 (cuDNN on an
# H100: kernels.cudnn_leads). The levers are the ones measured (--fit off: every block offloaded and keeping
# attention's output, unless EXTRA says otherwise); plan.py's predictions for them are checked in tests/test_plan.py. Each run starts in a process group
# of its own; a run cut by its timeout has that group ended, and nothing else.
set -u
OUT=$(mkdir -p "$1" && cd "$1" && pwd); shift
MODEL=${MODEL:-bench/configs/qwen3_5-9b}
ALL=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj
case $MODEL in *a3b*) ALL=q_proj,k_proj,v_proj,o_proj,in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj ;; esac
TARGETS=${TARGETS:-$ALL}  # the 35B-A3B's measured run: no MLP names (since, they adapt its shared expert)
for run in "$@"; do
    kind=${run%%:*}; tokens=${run#*:}
    case $kind in
        lora) flags=(--lora_rank 16 --lora_targets "$TARGETS") ;;
        full) flags=(--param_dtype bfloat16 --stochastic_rounding true) ;;
        *) echo "unknown run $run: want lora:TOKENS or full:TOKENS" >&2; exit 2 ;;
    esac
    name="q35$(basename "$MODEL" | grep -o -- '-35b-a3b')_${kind}_$tokens"
    # shellcheck disable=SC2086
    setsid timeout "${TIMEOUT:-$(( tokens < 100000 ? 300 : tokens < 300000 ? 480 : 590 ))}" python -m torch.distributed.run --standalone \
        --nproc_per_node 1 "${SCRIPT:-train.py}" --model "$MODEL" --tokenizer byte --data synthetic \
        --yarn_factor 0 --seq_len "$tokens" --max_steps 2 --fit off "${flags[@]}" ${EXTRA:-} \
        --checkpoints false --resume none --overwrite true --out_dir "/tmp/$name" > "$OUT/$name.log" 2>&1 &
    pid=$!; wait "$pid"; echo "$name rc $?" >> "$OUT/rc.txt"; kill -- "-$pid" 2>/dev/null
    cp "/tmp/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
    grep -E "^(fit|offload|model|step|error)|Warning|Error" "$OUT/$name.log" | tail -6
done
