"""Checkpoints that are either complete or absent, never half-written.

    checkpoints/step_0000120/   model + optimizer shards (torch.distributed.checkpoint: a file per rank, reloadable
                                on any world size), trainer.json (step, data position, config), manifest.json (every
                                file and its size, and the run's fingerprint)
    checkpoints/latest          the name of the newest complete checkpoint (for people and scripts)

A checkpoint is written into step_N.tmp/, its files fsynced, the manifest written last, then the folder is
renamed to step_N/ and `latest` replaced (write, fsync, rename: each step atomic on a POSIX file system). A
crash at any point leaves the previous checkpoints as they were. Old checkpoints are deleted only after the new
one is published, and renamed to *.trash first, so a half-deleted folder never has a checkpoint's name.

This file knows about files, not the model or the trainer's flags: the caller passes the state dicts, the
trainer state and a fingerprint (what must match for a checkpoint to belong to a run). Which checkpoint a run
continues from is rundir.py's policy. Exercised by tests/test_long_runs.py (faults injected into real runs).
"""
import json
import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import parallel

STEP_DIR = re.compile(r"^step_(\d{7,})$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:07d}")


def _fsync(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, obj):
    """Written in full and fsynced, or not at all (a .tmp beside it, then renamed)."""
    with open(path + ".tmp", "w") as fh:
        json.dump(obj, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".tmp", path)


def remove_dir(path: str):
    """Rename, then delete: a kill during the deletion leaves a *.trash folder, never a half checkpoint."""
    if not os.path.lexists(path):
        return
    trash = f"{path}.{os.getpid()}.trash"
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def clean_leftovers(root: str):
    """Delete what an interrupted save or deletion left behind (*.tmp and *.trash folders). Rank 0, at start."""
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.endswith((".tmp", ".trash")):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def publish(tmp: str, final: str):
    """Make the finished folder tmp appear as final in one rename (replacing an earlier final, if any)."""
    for dirpath, _, files in os.walk(tmp):
        for f in files:
            _fsync(os.path.join(dirpath, f))
    _fsync(tmp)
    remove_dir(final)
    os.replace(tmp, final)
    _fsync(os.path.dirname(os.path.abspath(final)))


def save(root: str, step: int, state: dict, trainer: dict, fingerprint: dict, keep: int):
    """Collective: every rank calls it with its own shards in `state`. Publishes root/step_N and prunes all but
    the newest `keep` checkpoints. An error (a full disk, say) is raised on every rank, and the half-written
    folder is removed; the earlier checkpoints are untouched."""
    rank, final = dist.get_rank(), step_dir(root, step)
    tmp = final + ".tmp"
    error = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = e
    error = _shared_error(error)
    if error is None:
        try:
            dcp.save(state, checkpoint_id=tmp)  # each rank writes its own file, fsynced (FileSystemWriter's default)
        except (Exception, CheckpointException) as e:  # dcp gathers every rank's failure into one
            error = e                                    # CheckpointException (a BaseException), raised on all
    error = _shared_error(error)  # every rank has written its shard before rank 0 publishes them
    if error is None and rank == 0:
        try:
            _write_json(os.path.join(tmp, "trainer.json"), trainer)
            files = {os.path.relpath(os.path.join(d, f), tmp): os.path.getsize(os.path.join(d, f))
                     for d, _, fs in os.walk(tmp) for f in fs}
            _write_json(os.path.join(tmp, "manifest.json"), {"step": step, "files": files, "fingerprint": fingerprint})
            publish(tmp, final)
            _write_json(os.path.join(root, "latest"), {"checkpoint": os.path.basename(final), "step": step})
            for old in sorted(list_steps(root), reverse=True)[keep:]:
                remove_dir(step_dir(root, old))
        except Exception as e:
            error = e
    error = _shared_error(error)
    if error is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        # A full disk does not always say so: torch's writer can fail first with "unexpected pos" on a short write
        last = list_steps(root)
        need = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(step_dir(root, last[-1]))
                   for f in fs) if last else 0
        free = shutil.disk_usage(root).free
        full = (f"; its disk has {free / 2**20:.1f} MiB free, less than the last checkpoint's {need / 2**20:.1f} "
                "MiB: free space or move --out_dir") if need > free else ""
        raise OSError(f"saving checkpoint {final} failed ({_first_line(error)}){full}; the earlier checkpoints are "
                      "intact") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    # dcp's CheckpointException lists each rank's traceback; the cause (e.g. "No space left on device") is in it
    for line in text.splitlines():
        if "Error" in line and ":" in line and not line.lstrip().startswith(("File", "Traceback")):
            return line.strip()[:300]
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def _shared_error(error):
    """Every rank learns whether any rank failed (parallel.agree), so all stop together. -> this rank's error, one
    saying that another rank failed, or None."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    if not parallel.agree([error is not None], device)[0]:
        return None
    return error if error is not None else RuntimeError("another rank failed (see its message)")


def list_steps(root: str) -> list[int]:
    """Steps of the published checkpoints in root (by folder name; not yet verified)."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(root)) if m)


def verify(path: str) -> str | None:
    """None if every file the manifest lists is there with its size, else what is wrong (one line)."""
    try:
        with open(os.path.join(path, "manifest.json")) as fh:
            manifest = json.load(fh)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"no readable manifest.json ({type(e).__name__})"
    for name, size in files.items():
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            return f"{name} is missing"
        if os.path.getsize(f) != size:
            return f"{name} has {os.path.getsize(f)} bytes, the manifest says {size}"
    if "trainer.json" not in files:
        return "trainer.json is not in the manifest"
    return None


def read_manifest(path: str) -> dict:
    with open(os.path.join(path, "manifest.json")) as fh:
        return json.load(fh)


def newest_valid(root: str, log) -> str | None:
    """The newest checkpoint in root that passes verify(); each one that fails is named in one line."""
    for step in sorted(list_steps(root), reverse=True):
        path = step_dir(root, step)
        problem = verify(path)
        if problem is None:
            return path
        log(f"warning: skipping checkpoint {path}: {problem}")
    return None


def fingerprint_mismatch(saved: dict, current: dict) -> str | None:
    """What differs between two fingerprints ("model.hidden_size 64 -> 32; ..."), or None if nothing does."""
    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out
    a, b = flat(saved), flat(current)
    diffs = [f"{k} {json.dumps(a.get(k))[:60]} -> {json.dumps(b.get(k))[:60]}"
             for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "") if diffs else None


def load(path: str, state: dict) -> dict:
    """Collective: fills `state` (this rank's shards, resharded from any world size) from path; -> trainer.json."""
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:
        raise OSError(f"loading checkpoint {path} failed ({_first_line(e)})") from None
    with open(os.path.join(path, "trainer.json")) as fh:
        return json.load(fh)
