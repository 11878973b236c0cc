"""A relaunch continues the run: what train.py's loop resumes from, and the checkpoint each save writes.

A run is its --out_dir. Relaunching the same command after any stop (a crash, kill -9, SIGTERM, a requeue, a
torchrun restart) loads the newest complete checkpoint (checkpoint.py, rundir.py) and continues with the same
losses as if it had never stopped. Nothing in out_dir changes until step 1 of a launch is done, but the lock file
of a folder that exists and the name of a checkpoint that fails (moved aside).

    pytest tests/e2e/test_long_runs.py -q      # kill -9, SIGTERM and requeues, then the same losses
"""
import dataclasses
import datetime
import math
import os
import socket
import time
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import data
from million import checkpoint, config, rundir
from million.export import all_finite
from million.survival import SharedError, from_rank0, on_rank0


@dataclass
class Run:
    """What the loop works on besides the model: the optimizer, the data and where the run stands."""
    setup: object            # train.Setup
    opt: torch.optim.Optimizer
    batches: data.Batches
    fingerprint: dict        # what a checkpoint must match to be resumed (rundir.fingerprint)
    done: int                # steps already trained (from the checkpoint resumed)
    lr_anchor: list | None   # [step, fraction of --lr] where a changed schedule continues from (train.lr_at)
    launch: dict             # this launch, for out_dir/launches.jsonl
    lock: "rundir.Lock | None"  # rank 0: out_dir is this run's
    metrics: "rundir.JsonlLog | None" = None  # rank 0, opened once the first step has run
    saved: int = -1          # the step of the newest checkpoint (-1: the one resumed, if any)

    def __post_init__(self):
        self.saved = self.done if self.saved < 0 else self.saved


def take_out_dir(cfg, device) -> "rundir.Lock | None":
    """Rank 0 locks --out_dir for this launch: a second launch into it stops here, with one line."""
    return on_rank0(lambda: rundir.Lock(cfg.out_dir), device)


def resume_changes(cfg, saved: dict) -> dict:
    """{flag: [value in the checkpoint's launch, value now]} for the flags that changed; stops on a fixed one
    (config.FIXED_ON_RESUME)."""
    now = dataclasses.asdict(cfg)
    changed = {k: [saved[k], v] for k, v in now.items()
               if k in saved and saved[k] != v and k not in ("config", "resume", "overwrite")}
    fixed = [k for k in changed if k in config.FIXED_ON_RESUME]
    if fixed:
        raise SharedError("error: a resumed run keeps " + ", ".join(f"--{k} {saved[k]} (given: {now[k]})"
                                                                   for k in fixed)
                          + "; use the values it started with, or another --out_dir for a new run")
    return changed


def schedule_anchor(cfg, saved: dict, anchor, done: int, lr_at) -> list | None:
    """Where the LR schedule continues from when its shape changed on resume (--max_steps, --warmup_steps or
    --min_lr_ratio): the fraction of --lr the run had reached at step `done`, on the old schedule. Without it,
    a cosine recomputed over a longer run would jump up."""
    keys = ("max_steps", "warmup_steps", "min_lr_ratio")
    if all(saved.get(k) == getattr(cfg, k) for k in keys) or done <= saved.get("warmup_steps", 0):
        return anchor  # unchanged, or still warming up (the cosine has not begun: nothing to jump from)
    old = dataclasses.replace(cfg, **{k: saved[k] for k in (*keys, "lr")})
    return [done, lr_at(done, old, anchor) / old.lr]


def resume(cfg, setup, opt, batches, lock, cp: int, world: int, log, lr_at) -> Run:
    """The checkpoint to continue from (if any) loaded into the model, optimizer and data; what changed since the
    launch that saved it; then the output checks (room for a checkpoint and the export)."""
    device = setup.device
    data_fp = {k: getattr(cfg, k) for k in ("data", "data_repo", "data_revision", "data_split", "data_column",
                                            "seq_len", "seed")}
    fp = rundir.fingerprint(setup.mcfg, setup.shapes, data_fp, data.tokenizer_spec(cfg.tokenizer, setup.model_path))
    candidates = from_rank0(on_rank0(lambda: rundir.resume_candidates(cfg.out_dir, cfg.resume, cfg.overwrite, fp,
                                                                      log), device))
    model_sd, optim_sd = get_state_dict(setup.model, opt, options=checkpoint.STATE)
    state = {"model": model_sd, "optim": optim_sd}
    done, anchor, changes = 0, None, {}
    if candidates:
        t0 = time.time()
        resume_from, meta = rundir.load_newest(candidates, state, device, log, exc=SharedError,
                                               move_aside=cfg.resume == "auto")
        changes = resume_changes(cfg, meta["config"])
        set_state_dict(setup.model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=checkpoint.STATE)
        batches.load_state_dict(meta["data"])
        done = meta["step"]
        anchor = schedule_anchor(cfg, meta["config"], meta.get("lr_anchor"), done, lr_at)
        log(f"resumed from {resume_from} after step {done} (loaded in {time.time() - t0:.1f} s)")
        if changes:
            log("changed since the launch that saved it: " + "; ".join(f"--{k} {a} -> {b}" for k, (a, b) in
                                                                        changes.items()))
        if anchor != meta.get("lr_anchor") and done < cfg.max_steps:
            log(f"the LR schedule continues at step {done + 1} with {lr_at(done + 1, cfg, anchor):.3g}, on a cosine "
                f"to {cfg.lr * cfg.min_lr_ratio:.3g} at step {cfg.max_steps}, without a jump (to warm up again, "
                "start a new run from an export: --model SAVE_DIR)")
    check_outputs(cfg, setup, state, world, log)
    launch = dict(started=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                  host=socket.gethostname(), world=world, cp=cp, from_step=done, changes=changes, lr_anchor=anchor)
    return Run(setup, opt, batches, fp, done, anchor, launch, lock)


def check_outputs(cfg, setup, state: dict, world: int, log):
    """Stop before step 1 when --out_dir cannot hold the checkpoints kept, or --save_dir the export."""
    n_params, pbytes = sum(math.prod(x) for x in setup.shapes.values()), getattr(torch, cfg.param_dtype).itemsize
    n_trained = sum(p.numel() for p in setup.model.parameters() if p.requires_grad)  # LoRA: the adapters
    ckpt_bytes = checkpoint.state_bytes(state, world) if cfg.checkpoints else 0  # with false: writable, no size
    copies = on_rank0(lambda: rundir.checkpoints_to_fit(cfg.out_dir, cfg.keep_checkpoints), setup.device)
    needs = [(cfg.out_dir, "--out_dir", "a checkpoint", ckpt_bytes, copies)]
    if cfg.save_dir:
        exported = n_trained if cfg.lora_rank and not cfg.merge_lora else n_params
        needs.append((cfg.save_dir, "--save_dir", "the exported model", exported * pbytes, 1))
    on_rank0(lambda: rundir.check_outputs(needs), setup.device)
    if cfg.checkpoints:
        log(f"outputs: a checkpoint is about {rundir.human_bytes(ckpt_bytes)}; {cfg.keep_checkpoints} kept")


def begin_files(cfg, run: Run, log):
    """Rank 0, once step 1 is done: out_dir's files (rundir.begin) and train.log."""
    run.metrics = rundir.begin(cfg.out_dir, run.done, dataclasses.asdict(cfg), run.launch, run.lock)
    log.open(os.path.join(cfg.out_dir, "train.log"))


def save_checkpoint(cfg, run: Run, step: int, log):
    """A checkpoint of step `step` in out_dir/checkpoints (checkpoint.save), never of non-finite weights."""
    if not all_finite(run.setup.model):
        raise SharedError(f"error: the weights hold non-finite values at step {step}; not saving them. The newest "
                          "checkpoint in out_dir is the last good state")
    t0 = time.time()
    model_sd, optim_sd = get_state_dict(run.setup.model, run.opt, options=checkpoint.STATE)
    root = os.path.join(cfg.out_dir, "checkpoints")
    checkpoint.save(root, step, {"model": model_sd, "optim": optim_sd},
                    {"step": step, "data": run.batches.state_dict(), "config": dataclasses.asdict(cfg),
                     "lr_anchor": run.lr_anchor},
                    run.fingerprint, keep=cfg.keep_checkpoints)
    log(f"checkpoint: step {step} saved to {checkpoint.step_dir(root, step)} in {time.time() - t0:.1f} s")


def check_health(cfg, step: int, skipped: int, zero_norm: int, log):
    """Warn of a dead model; stop after --max_skipped_steps non-finite steps in a row."""
    if zero_norm == 3:
        log("warning: the gradient norm has been exactly 0 for 3 steps: the model may be dead (a loss flat at "
            "ln(vocab) says so); check --lr and the data")
    if skipped >= cfg.max_skipped_steps:
        raise SharedError(f"error: {skipped} steps in a row had a non-finite loss or gradient norm (the last at step "
                          f"{step}); they changed no weights. Lower --lr, check the data, or resume from an earlier "
                          "checkpoint")
