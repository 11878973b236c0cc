"""The loss by position (every step, in metrics.jsonl) and held-out evaluation (out_dir/eval.jsonl).

    torchrun --standalone --nproc_per_node 2 train.py --config demo --eval_every 50     # during training
    torchrun --standalone --nproc_per_node 2 train.py --config demo --model SAVE_DIR --eval_only true
    python -m pytest tests/e2e/test_positions.py -q

An evaluation runs training's forward (ring attention, chunked loss) under no_grad on the first --eval_sequences
windows of --eval_data's --eval_split: the same windows every time, so rows compare.
"""
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from million import checkpoint
from million import config
import data
from million import fit
from million import retrieval
from million import rundir
from million.survival import SharedError, from_rank0, on_rank0


class PositionSums:
    """The loss summed over rows, and over each of k equal spans of position: a row at position p (the input
    token whose successor is predicted; with packed documents, its place in its document) lies in span
    p·k // seq_len, wherever zigzag sharding put it. Adding chunked_nll's row_nll costs two index_adds of T/cp
    values; reduce() is one all-reduce of 2k + 2 numbers, the collective the loss alone needed anyway."""

    def __init__(self, seq_len: int, k: int, device):
        self.seq_len, self.k, self.has_aux = seq_len, k, False
        self.acc = torch.zeros(2 + 2 * k, device=device)  # [loss sum, aux sum, loss sum by span, targets by span]

    def add(self, out, m: "data.Micro"):
        """out: the model's loss.NLL for one micro-batch's rows on this rank (a MoE's moe.MoENLL adds aux_sum)."""
        bucket = m.positions[0] * self.k // self.seq_len                     # [T/cp] the span of each row
        self.acc[0] += out.loss_sum.detach()
        aux = getattr(out, "aux_sum", None)
        if aux is not None:
            self.acc[1] += aux.detach()
            self.has_aux = True
        self.acc[2:2 + self.k].index_add_(0, bucket, out.row_nll)
        self.acc[2 + self.k:].index_add_(0, bucket, (m.labels[0] != -100).to(self.acc.dtype))

    def reduce(self, group=None):
        """Summed over the ranks of `group` (default: all: context, data parallel) -> (loss sum, aux sum or None
        for a model without one, as 0-d tensors; [k] mean loss by span, None where not finite: JSON has no NaN)."""
        dist.all_reduce(self.acc, group=group)
        k, acc = self.k, self.acc
        by_span = [x if math.isfinite(x) else None for x in (acc[2:2 + k] / acc[2 + k:]).tolist()]
        return acc[0], (acc[1] if self.has_aux else None), by_span

    def count(self) -> int:
        """Target tokens summed (after reduce())."""
        return int(self.acc[2 + self.k:].sum().item())


def peak_memory(cfg, device) -> float:
    """Peak GPU memory (CPU: max RSS) in bytes, the largest over ranks."""
    peak = torch.tensor([torch.cuda.max_memory_allocated() if cfg.device == "cuda" else
                         resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64,
                        device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def eval_due(cfg, step: int) -> bool:
    return cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.max_steps)


def open_eval_log(cfg, done: int, device) -> "rundir.JsonlLog | None":
    """Rank 0: out_dir/eval.jsonl, cut back to the resumed step like metrics.jsonl (an --eval_only run passes
    done = sys.maxsize: it keeps every earlier row and adds its own). None on the other ranks."""
    def open_log():
        os.makedirs(cfg.out_dir, exist_ok=True)
        return rundir.JsonlLog(os.path.join(cfg.out_dir, "eval.jsonl"), done)
    return on_rank0(open_log, device)


def start_eval_log(cfg, done: int, device, first_eval, first_needles, log) -> "rundir.JsonlLog | None":
    """Once step 1 is done: rank 0's eval.jsonl (with --eval_every), holding the evaluation of step 0 if one
    was made before the first step, and retrieval's files of step 0."""
    eval_log = open_eval_log(cfg, done, device) if cfg.eval_every else None
    if eval_log and first_eval:
        eval_log.write(first_eval)
    if first_needles:  # rank 0's retrieval row of step 0
        retrieval.write_files(cfg, first_needles, log)
    return eval_log


def evaluate(cfg, setup, make_batches, step: int, eval_log, log, hold: bool = False) -> tuple[dict, dict | None]:
    """_evaluate in eval mode (nothing kept for a backward: lora.LoRAMLP's kept MLP outputs), then back."""
    was = setup.model.training
    setup.model.eval()
    try:
        return _evaluate(cfg, setup, make_batches, step, eval_log, log, hold)
    finally:
        setup.model.train(was)


def _evaluate(cfg, setup, make_batches, step: int, eval_log, log, hold: bool = False) -> tuple[dict, dict | None]:
    """The loss on the first --eval_sequences windows of --eval_data's --eval_split, overall and over
    --loss_buckets spans of position. setup: train.Setup (mesh, model, mcfg, device); make_batches: train's
    (cfg, setup, source, split, grad_accum) -> data.Batches, the loader training reads through. No block is
    recomputed or offloaded, as nothing is kept for a backward. Windows are dealt round-robin to the data-parallel
    groups, so their count rounds up to a multiple of data parallel. -> (the row of out_dir/eval.jsonl, the
    retrieval test's row or None). hold: write neither (the evaluation before step 1: a failed start writes
    nothing; train.py writes both once step 1 is done)."""
    t0, dp = time.time(), setup.mesh.size(0)
    source = cfg.eval_data or cfg.data
    batches = make_batches(cfg, setup, source, cfg.eval_split, 1)
    if cfg.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sums, sequences = PositionSums(cfg.seq_len, cfg.loss_buckets, setup.device), 0
    try:
        with torch.no_grad():
            while sequences < cfg.eval_sequences:
                try:
                    [m] = batches.next()
                except data.DataEnd:
                    break
                except data.DataError as e:  # every rank has it
                    raise SystemExit(f"{e}; in the evaluation of step {step}") from None
                out = setup.model(m.inputs, m.positions, m.labels, loss_chunk=cfg.loss_chunk,
                                  doc_lens=getattr(m, "doc_lens", None))  # packing.PackedMicro's
                sums.add(out, m)
                sequences += dp
    finally:
        batches.close()
    if sequences == 0:  # the loader reports data shorter than one window per rank itself; this is the rest
        raise SharedError(f"error: --eval_data {source} (split {cfg.eval_split}) has no window of --seq_len + 1 "
                          "tokens")
    loss_sum, _, by_position = sums.reduce()
    n = sums.count()  # the target tokens of every window read, over every rank
    peak = peak_memory(cfg, setup.device) if cfg.device == "cuda" else None
    rec = dict(step=step, loss=loss_sum.item() / max(n, 1), loss_by_position=by_position, sequences=sequences,
               num_tokens=n, seq_len=cfg.seq_len, eval_data=source, eval_split=cfg.eval_split, model=cfg.model,
               rope_scaling=setup.mcfg.rope_scaling, eval_time_s=time.time() - t0,
               peak_mem_gib=peak / 2**30 if peak is not None else None)
    log(f"eval {step:4d} | loss {rec['loss']:.4f} on {sequences} x {cfg.seq_len:,} tokens | by position: "
        + " ".join("-" if x is None else f"{x:.2f}" for x in by_position) + f" | {rec['eval_time_s']:.1f} s"
        + (f" | peak mem {rec['peak_mem_gib']:.1f} GiB" if peak is not None else ""))
    if eval_log and not hold:
        eval_log.write(rec)
    needles = None
    if cfg.retrieval:  # the needle test at the same step (retrieval.py)
        shape = fit.plan_shape(cfg, setup.mcfg, setup.mesh.size()) if cfg.device == "cuda" else None
        needles = retrieval.run(cfg, setup, step, log, shape, write=not hold)
    return rec, needles


# What defines a checkpoint's weights: --eval_only on a run's folder takes them from the run's config
WEIGHT_FLAGS = ("model", "tokenizer", "yarn_factor", "yarn_original_max_position_embeddings", "param_dtype",
                "lora_rank", "lora_alpha", "lora_targets", "quantize")


def evaluate_only(cfg, given: set, cp: int, world: int, device, log, build, make_batches) -> int:
    """--eval_only true: evaluate once at --seq_len and add a row to out_dir/eval.jsonl. The weights are those of
    the newest checkpoint in --out_dir that verifies (the row's step is its step; the model as the run defined
    it), or, where --model is named or there is none, --model's (with --yarn_factor if given; step 0). The
    model is sharded as for training; no optimizer, no training data. A run live in --out_dir is not disturbed:
    its lock stops this launch. build, make_batches: train.py's (the model and the loader training uses)."""
    named = "model" in given and cfg.model != config.PRESETS[cfg.config].get("model")  # a preset's own is not
    lock = None

    def find():  # rank 0: the lock of a run's folder, its checkpoints whose files are whole, the newest's config
        nonlocal lock
        lock = rundir.lock_if_run(cfg.out_dir)
        paths = [] if named or not os.path.isdir(cfg.out_dir) else rundir.published(cfg.out_dir, log)
        return paths, next((t["config"] for t in map(checkpoint.read_trainer, paths) if t), None)
    paths, saved = from_rank0(on_rank0(find, device))
    for k in WEIGHT_FLAGS if saved else ():
        setattr(cfg, k, saved.get(k, getattr(cfg, k)))
    setup = build(cfg, given, cp, world, device, log)
    step, what = 0, cfg.model
    if paths:
        fp = rundir.fingerprint(setup.mcfg, setup.shapes, {}, data.tokenizer_spec(cfg.tokenizer, setup.model_path))
        on_rank0(lambda: [rundir.check_fingerprint(p, {k: v for k, v in fp.items() if k != "data"}) for p in paths],
                 device)
        state = {"model": get_model_state_dict(setup.model, options=checkpoint.STATE)}
        path, trainer = rundir.load_newest(paths, state, device, log, exc=SharedError)
        set_model_state_dict(setup.model, state["model"], options=checkpoint.STATE)
        step, what = trainer["step"], f"checkpoint {path} (step {trainer['step']}; --model NAME evaluates another)"
    log(f"eval only: {what}, rope_scaling {setup.mcfg.rope_scaling}, {cfg.eval_sequences} sequence(s) of "
        f"{cfg.seq_len:,} tokens from {cfg.eval_data or cfg.data} ({cfg.eval_split})")
    evaluate(cfg, setup, make_batches, step, open_eval_log(cfg, sys.maxsize, device), log)
    return 0
