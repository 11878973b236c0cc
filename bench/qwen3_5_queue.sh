#!/usr/bin/env bash
# Qwen3.5's GPU jobs, queued: it runs in the background on the GPU machine, so that it goes on
# between the calls that watch it (a call lasts 10 minutes at most; a run of 524,288 tokens takes about as long).
#
#   bash bench/qwen3_5_queue.sh start JOB...   # in the call that installs the wheels (bench/gpu_wheels.sh; its
#                                              # `download fla` bundle, two calls, when FA4 is not wanted)
#   bash bench/qwen3_5_queue.sh wait OUT SECS  # in the next calls: wait for the queue to end or for SECS seconds,
#                                              # then copy everything it wrote so far into OUT
#
# JOB, run in the order given, each with its own timeout; its files land in /tmp/queue/JOB:
#   tests       the rule test at the 9B's heads (fills Triton's cache), then the model-level fla check
#   moe_tests   the MoE's GPU tests (the grouped GEMMs and the experts' adapters against the loop)
#   moe         the 35B-A3B's LoRA step at 131,072 tokens (attention and DeltaNet adapted)
#   moe_shared  the same with the MLP names too (the shared expert's adapters)
#   moe_experts the same as moe with the routed experts adapted too (--lora_targets ...,experts)
#   qlora       the 9B's LoRA step at 131,072 tokens on NF4 weights (torchao on the path)
#   qlora_moe   the 35B-A3B's LoRA step at 131,072 tokens on NF4 weights, its routed experts' included (fits an
#               80 GB GPU; torchao on the path)
#   qlora_moe_long  the same at 524,288 tokens, 38 of 40 blocks offloaded (an H200: it ran out of memory on an H100)
#   qlora_moe_262k  the same at 262,144 tokens, the DeltaNet in pieces of 16,384 (the levers plan.py picks for an H100)
#   qlora_moe_393k  the same at 393,216 tokens with --fit auto (an H100: every block offloaded and keeping
#               attention, the DeltaNet in pieces of 16,384; 142.6 s at the H200's rates, 66.2 GiB predicted)
#   qlora_moe_458k  the same at 458,752 tokens: the longest plan.py fits on an H100 since the three memory fixes of
#               2026-12-07 (70.0 GiB and 187.0 s at the H200's rates predicted, 105.3 GiB pinned)
#   qlora_moe_524k  the same at 524,288 tokens, planned for an H100 (--fit auto --gpu_mem_gib 78.0: the free memory
#               an H100 80GB reads) and run under bench/capped.py with the allocator capped at 78 GiB, so that on an
#               H200 too it has no more room than on an H100 (the longest before, 458,752, with the cache's 16 GiB)
#   cut_524k    the 35B-A3B's 12-layer cut with QLoRA at 524,288 tokens, 2 steps (gated attention's working set at
#               that length on this code, in less than half the time of qlora_moe_524k)
#   cut_long    the 35B-A3B's 12-layer cut with QLoRA at 524,288 tokens, one step traced: what is alive at the peak
#   mem262      the 9B's LoRA at 262,144 tokens with the levers --fit auto picked for an H100 in `table` (every block
#               offloaded, the DeltaNet in pieces of 16,384): its peak after gated attention's q and gate fix
#   mem262_capped  mem262 under bench/capped.py, PyTorch's allocator capped at CAP_GIB (50) GiB: does the run need
#               the reserve it builds beyond its allocated peak?
#   trace262    mem262's run, one step traced: what is alive at its peak (54.0 GiB against the plan's 49.2; gated
#               attention's backward, itemized on the cut's trace, comes to about 51 there)
#   root_ab     bench/memory_ab.sh on the 9B's first 4 layers (3 DeltaNet, 1 attention; bench/configs/qwen3_5-9b-4l)
#               at 131,072 tokens: the code as it is against a copy without the three memory fixes of 2026-12-07.
#               Predicted: the embedding and head (2 x 248,320 x 4,096 x 2 B = 3.79 GiB), the recompute's output
#               (1 GiB) and 3 of the 4 pairs of cos and sin (96 MiB): 4.88 GiB less
#   long        the 9B's LoRA at 524,288 tokens, the DeltaNet in pieces of 16,384
#   longest     the 9B's LoRA at 589,824 tokens with --fit auto (an H200: the longest plan.py fits on one)
#   table       the 9B's LoRA at 65,536 and 262,144 tokens, the levers --fit auto picks (TRL's table's other two
#               lengths)
#   lora131k    the 9B's LoRA at 131,072 tokens, the levers --fit auto picks for the card it runs on (on an H100:
#               every block offloaded and keeping attention, no MLP outputs kept)
#   moe_tile    the 35B-A3B's LoRA step with tiles of 65,536 rows (~2,048 rows an expert, not ~512)
#   cut         the 35B-A3B's 12-layer cut (fits an 80 GB GPU), LoRA on attention and DeltaNet, 4 steps (2-4 timed)
#   ab          on a 12-layer cut of the 35B-A3B (fits an 80 GB GPU): LoRA as the code is, with the experts adapted,
#               and as the tiled MoE's backward was before it skipped frozen weights
#   profile     the 35B-A3B's LoRA step 2 traced, and its summary (bench/profile_step.py)
#   profile_experts  the same with the routed experts adapted too
#   attn_ab     the 9B's LoRA step at 131,072 tokens with --attn_backend fa4, then cudnn (head_dim 256)
#   rows        bench/moe_rows.py: one MoE tile's row permutations and weighted sum, timed both ways
#   fa4_groups  FA4's backward over head groups (one head a call, dK/dV summed) against one call, on the GPU
#   overhead    bench/gpu_overhead.py: what a process holds on the GPU outside PyTorch's allocator, stage by stage
#               (up to 10 minutes: fla's autotuner runs each time, and Triton's cache may be cold)
set -u
Q=/tmp/queue
# Triton's compiled kernels and fla's autotuning results, kept on disk (on a fresh machine the 9B's 262k run took
# 418 s to its first step, with the cache cold): the `wait` that sees the queue end packs them into
# OUT/triton_cache.tar.xz.part?? (30 MB each: larger files do not come back); copied to .whl/ and carried into a
# later machine's `start` call, they are unpacked before the first run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache} TRITON_CACHE_AUTOTUNING=1
ALL=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj
AD=q_proj,k_proj,v_proj,o_proj,in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj  # attention and DeltaNet
MOE=${MOE:-bench/configs/qwen3_5-35b-a3b}  # MOE=bench/configs/qwen3_5-35b-a3b-12l: its first 12 layers (an 80 GB GPU)

profiled() {  # TARGETS OUT: the 35B-A3B's LoRA step 2 traced, and its summary (bench/profile_step.py)
    MODEL=$MOE TARGETS=$1 EXTRA="--profile_step 2" bash bench/qwen3_5_gpu.sh "$2" lora:131072 &&
        python bench/profile_step.py --dir /tmp/q35-35b-a3b_lora_131072/profile > "$2/profile.txt" 2>&1
    cp /tmp/q35-35b-a3b_lora_131072/profile/summary.json "$2/"
}

job() {  # name: one job, its output into $Q/name
    local d=$Q/$1
    mkdir -p "$d"
    case $1 in
        tests) timeout 500 python -m pytest -m gpu -p no:xdist -s tests/test_qwen3_5.py \
                   -k "kernel_matches_the_torch_rule and 8192 or model_matches" > "$d/gpu_tests.log" 2>&1
               bash "$0" job moe_tests ;;
        moe_tests) timeout 200 python -m pytest -m gpu -p no:xdist -s tests/test_moe.py > "$d/gpu_tests_moe.log" 2>&1 ;;
        moe) MODEL=$MOE bash bench/qwen3_5_gpu.sh "$d" lora:131072 ;;
        moe_shared) MODEL=$MOE TARGETS=$ALL bash bench/qwen3_5_gpu.sh "$d" lora:131072 ;;
        moe_experts) MODEL=$MOE TARGETS=$AD,experts bash bench/qwen3_5_gpu.sh "$d" lora:131072 ;;
        qlora) EXTRA="--quantize nf4" bash bench/qwen3_5_gpu.sh "$d" lora:131072 ;;
        qlora_moe) MODEL=$MOE EXTRA="--quantize nf4" TIMEOUT=590 bash bench/qwen3_5_gpu.sh "$d" lora:131072 ;;
        qlora_moe_long) MODEL=$MOE EXTRA="--quantize nf4 --deltanet_tile 16384 --offload_layers 38" TIMEOUT=1500 \
                        bash bench/qwen3_5_gpu.sh "$d" lora:524288 ;;
        qlora_moe_262k) MODEL=$MOE EXTRA="--quantize nf4 --deltanet_tile 16384" TIMEOUT=900 \
                        bash bench/qwen3_5_gpu.sh "$d" lora:262144 ;;
        qlora_moe_393k) MODEL=$MOE EXTRA="--quantize nf4 --fit auto" TIMEOUT=900 \
                        bash bench/qwen3_5_gpu.sh "$d" lora:393216 ;;
        qlora_moe_458k) MODEL=$MOE EXTRA="--quantize nf4 --fit auto" TIMEOUT=1000 \
                        bash bench/qwen3_5_gpu.sh "$d" lora:458752 ;;
        qlora_moe_524k) MODEL=$MOE SCRIPT=bench/capped.py CAP_GIB=78 EXTRA="--quantize nf4 --fit auto --gpu_mem_gib 78.0" \
                        TIMEOUT=1100 bash bench/qwen3_5_gpu.sh "$d" lora:524288 ;;
        cut_524k) MODEL=bench/configs/qwen3_5-35b-a3b-12l EXTRA="--quantize nf4 --deltanet_tile 16384" TIMEOUT=560 \
                  bash bench/qwen3_5_gpu.sh "$d" lora:524288 ;;
        cut_long) MODEL=bench/configs/qwen3_5-35b-a3b-12l EXTRA="--quantize nf4 --deltanet_tile 16384 --max_steps 1 \
                  --profile_step 1" TIMEOUT=560 bash bench/qwen3_5_gpu.sh "$d" lora:524288 &&
                      python bench/profile_step.py --dir /tmp/q35-35b-a3b_lora_524288/profile > "$d/profile.txt" 2>&1
                  cp /tmp/q35-35b-a3b_lora_524288/profile/summary.json "$d/" ;;
        mem262) EXTRA="--deltanet_tile 16384" TIMEOUT=480 bash bench/qwen3_5_gpu.sh "$d" lora:262144 ;;
        mem262_capped) SCRIPT=bench/capped.py CAP_GIB=${CAP_GIB:-50} EXTRA="--deltanet_tile 16384" TIMEOUT=480 \
                       bash bench/qwen3_5_gpu.sh "$d" lora:262144 ;;
        trace262) EXTRA="--deltanet_tile 16384 --max_steps 1 --profile_step 1" TIMEOUT=480 \
                  bash bench/qwen3_5_gpu.sh "$d" lora:262144 &&
                      python bench/profile_step.py --dir /tmp/q35_lora_262144/profile > "$d/profile.txt" 2>&1
                  cp /tmp/q35_lora_262144/profile/summary.json "$d/" ;;
        root_ab) bash bench/memory_ab.sh "$d" bench/configs/qwen3_5-9b-4l 131072 --lora_rank 16 --lora_targets $ALL \
                     --deltanet_tile 16384 > "$d/ab.txt" 2>&1 ;;
        long) EXTRA="--deltanet_tile 16384 --offload_layers 23" TIMEOUT=900 bash bench/qwen3_5_gpu.sh "$d" lora:524288 ;;
        longest) EXTRA="--fit auto" TIMEOUT=1200 bash bench/qwen3_5_gpu.sh "$d" lora:589824 ;;
        table) EXTRA="--fit auto" TIMEOUT=590 bash bench/qwen3_5_gpu.sh "$d" lora:65536 lora:262144 ;;
        lora131k) EXTRA="--fit auto" bash bench/qwen3_5_gpu.sh "$d" lora:131072 ;;
        moe_tile) MODEL=$MOE EXTRA="--mlp_tile 65536" bash bench/qwen3_5_gpu.sh "$d" lora:131072 ;;
        cut) MODEL=bench/configs/qwen3_5-35b-a3b-12l TARGETS=$AD EXTRA="--max_steps 4" bash bench/qwen3_5_gpu.sh "$d" lora:131072 ;;
        ab) # the 35B-A3B cut to 12 layers (an 80 GB GPU holds it): LoRA on attention and DeltaNet as the code is, then
            # with the routed experts adapted too, then as the code was before the tiled MoE's backward skipped frozen
            # weights (every weight a leaf again); 4 steps each, steps 2-4 timed
            local cut=bench/configs/qwen3_5-35b-a3b-12l
            MODEL=$cut TARGETS=$AD EXTRA="--max_steps 4" bash bench/qwen3_5_gpu.sh "$d/after" lora:131072
            MODEL=$cut TARGETS=$AD,experts EXTRA="--max_steps 4" bash bench/qwen3_5_gpu.sh "$d/experts" lora:131072
            sed -i 's/train = ctx.needs_input_grad\[4:\]/train = [True] * len(ws)/' million/moe.py
            MODEL=$cut TARGETS=$AD EXTRA="--max_steps 4" bash bench/qwen3_5_gpu.sh "$d/before" lora:131072
            sed -i 's/train = \[True\] \* len(ws)/train = ctx.needs_input_grad[4:]/' million/moe.py ;;
        profile) profiled $AD "$d" ;;
        profile_experts) profiled $AD,experts "$d" ;;
        attn_ab) for b in fa4 cudnn; do EXTRA="--attn_backend $b" bash bench/qwen3_5_gpu.sh "$d/$b" lora:131072; done ;;
        fa4_groups) timeout 300 python -m pytest -m gpu -p no:xdist tests/test_fa4.py -k head_groups > "$d/fa4_groups.log" 2>&1 ;;
        overhead) timeout 600 python -m torch.distributed.run --standalone --nproc_per_node 1 bench/gpu_overhead.py \
                      --out "$d/overhead.json" > "$d/overhead.log" 2>&1 ;;
        rows) timeout 200 python bench/moe_rows.py --out "$d/moe_rows.json" > "$d/moe_rows.log" 2>&1 ;;
        *) echo "unknown job $1" > "$d/error.txt" ;;
    esac
    echo "$1 rc $? at $(date +%T)" >> $Q/done.txt
}

case "${1:-}" in
start)
    shift; mkdir -p $Q "$TRITON_CACHE_DIR"; : > $Q/done.txt
    if ls .whl/triton_cache.tar.xz.part?? > /dev/null 2>&1; then
        cat .whl/triton_cache.tar.xz.part?? | tar -xJf - -C "$TRITON_CACHE_DIR"
    fi
    # the card's memory as the driver sees it (PyTorch's allocator and everything outside it), every 10 s
    setsid bash -c "while sleep 10; do echo \$(date +%T) \$(nvidia-smi --query-gpu=memory.used --format=csv,noheader)
        done" > $Q/smi.txt 2>&1 &
    setsid bash -c "for j in $*; do bash $0 job \$j; done; echo all >> $Q/done.txt" > $Q/queue.log 2>&1 &
    echo "queue started: $*" ;;
job) job "$2" ;;
wait)
    OUT=$2; t=0
    while ! grep -qx all $Q/done.txt 2>/dev/null && [ "$t" -lt "$3" ]; do sleep 5; t=$((t + 5)); done
    cp -r $Q/. "$OUT/"
    if grep -qx all $Q/done.txt; then
        tar -cf - -C "$TRITON_CACHE_DIR" . | xz -T0 -6 | split -b 30M - "$OUT/triton_cache.tar.xz.part"
        du -ch "$OUT"/triton_cache.tar.xz.part?? | tail -1
    fi
    nvidia-smi --query-gpu=memory.used --format=csv,noheader
    cat $Q/done.txt; tail -3 $Q/*/rc.txt 2>/dev/null; grep -h "^step\|^error" $Q/*/*.log 2>/dev/null | tail -8 ;;
*) echo "usage: bash bench/qwen3_5_queue.sh start JOB... | wait OUT SECONDS" >&2; exit 2 ;;
esac
