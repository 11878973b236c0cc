"""train.py with one fault injected, for the tests in tests/e2e (never a user-facing switch).

    FAULT=kill:RANK:STEP        torchrun ... tests/e2e/fault_run.py <train.py flags>   # SIGKILL mid-step
    FAULT=kill_in_save:RANK:STEP                                                   # SIGKILL inside a checkpoint write
    FAULT=kill_in_delete:0:STEP                                                    # SIGKILL while an old one is deleted
    FAULT=nan:STEP[:LAST]        a NaN in one gradient on steps STEP..LAST (default: STEP only)
    FAULT=fill:STEP:BYTES        before step STEP, rank 0 fills the disk of --out_dir to BYTES free (a file beside it)

A fault fires only in torchrun's first launch (TORCHELASTIC_RESTART_COUNT 0): a run that torchrun restarts
is the same command without it (the tests relaunch by hand without FAULT). The wrappers replace module-level
names that train.py and checkpoint.py look up at call time; nothing else changes.
"""
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from million import checkpoint  # noqa: E402
import parallel  # noqa: E402
import train  # noqa: E402

kind, *nums = os.environ.get("FAULT", "none").split(":")
first_launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
rank = int(os.environ.get("RANK", "0"))
current = {"step": 0}


def die():
    os.kill(os.getpid(), signal.SIGKILL)


_lr_at = train.lr_at


def lr_at(step, cfg, *rest):  # called once per step, just before train_step: tells the wrappers which step runs
    if kind == "fill" and first_launch and rank == 0 and step == int(nums[0]) != current["step"]:
        filler = os.path.join(os.path.dirname(os.path.abspath(cfg.out_dir)), "filler")
        with open(filler, "wb") as fh:
            fh.write(b"\0" * (os.statvfs(filler).f_bavail * os.statvfs(filler).f_frsize - int(nums[1])))
    current["step"] = step
    return _lr_at(step, cfg, *rest)


train.lr_at = lr_at
_clip = parallel.clip_grad_norm_


def clip_grad_norm_(params, max_norm):
    params = list(params)
    step = current["step"]
    if kind == "kill" and first_launch and rank == int(nums[0]) and step == int(nums[1]):
        die()  # after forward and backward, before the optimizer: mid-step
    if kind == "nan" and int(nums[0]) <= step <= int(nums[-1]) and rank == 0:
        g = params[0].grad
        (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("nan")
    return _clip(params, max_norm)


parallel.clip_grad_norm_ = clip_grad_norm_  # train.py calls it as parallel.clip_grad_norm_

if kind == "kill_in_save":
    import torch.distributed.checkpoint as dcp
    _save = dcp.save

    def save(state, checkpoint_id):  # this rank's shard file is written; the manifest is not
        _save(state, checkpoint_id=checkpoint_id)
        if first_launch and rank == int(nums[0]) and current["step"] == int(nums[1]):
            die()
    dcp.save = save

if kind == "kill_in_delete":
    import shutil
    _rmtree = shutil.rmtree

    def rmtree(path, *a, **k):  # the old checkpoint is renamed to *.trash; half of it is deleted, then the kill
        if first_launch and path.endswith(".trash") and current["step"] == int(nums[1]):
            files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
            for f in files[: len(files) // 2]:
                os.remove(f)
            die()
        return _rmtree(path, *a, **k)
    checkpoint.shutil.rmtree = rmtree

if __name__ == "__main__":
    torch.set_num_threads(1)
    train.main(sys.argv[1:])
