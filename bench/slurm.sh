#!/bin/bash
# One 8-GPU node; on preemption the run saves a checkpoint and the job requeues itself, and the requeued job
# runs the same command, which resumes from that checkpoint.   sbatch bench/slurm.sh
# The signal comes 900 s before the end: at least a step and a checkpoint save (bench/RESULTS.md).
#SBATCH --nodes 1 --gpus-per-node 8 --time 24:00:00
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
# USR1 goes to the workers only (torchrun itself would die of it); the flag, not torchrun's exit code, says requeue.
trap 'preempted=1; pkill -USR1 -P "$TORCHRUN"' USR1
torchrun --standalone --nproc_per_node 8 --max-restarts 0 train.py --out_dir runs/qwen3-8b-1m &
TORCHRUN=$!
wait "$TORCHRUN"; code=$?
if [ "${preempted:-0}" = 1 ]; then
    wait "$TORCHRUN"   # the first wait returned when the trap ran; the workers are saving
    scontrol requeue "$SLURM_JOB_ID"   # the requeued job waits for nothing: out_dir's lock is freed on exit
    exit 0
fi
exit "$code"
