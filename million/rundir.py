"""The run's folder: what makes `--out_dir` one run that any relaunch continues.

    out_dir/lock                 held by the run writing here (one writer per folder)
    out_dir/train_config.json    the config the run started with
    out_dir/launches.jsonl       one row per launch: the step it continued from, what changed, its config
    out_dir/metrics.jsonl        one row per optimizer step, exactly once each (cut back to the step resumed)
    out_dir/eval.jsonl           one row per evaluation
    out_dir/train.log            what rank 0 printed, appended: the record when the terminal or the pipe is gone
    out_dir/checkpoints/         checkpoint.py's atomic checkpoints

This is the trainer's policy around checkpoint.py's mechanism: one writer per folder, which checkpoint a relaunch
continues from and whether it belongs to this run (the fingerprint), falling back past one that fails its
checksums or its load, whether the outputs have room, and the logs, which only ever hold whole lines. Nothing is
written, and no folder made, until the first step has run (a start that fails changes no file), and an earlier
run that --overwrite replaces is deleted only then. It runs on rank 0, but for load_newest (every rank); train.py
shares its answers and errors with the other ranks. Exercised by tests/e2e/test_long_runs.py and
tests/test_checkpoint.py (faults injected into real runs).
"""
import contextlib
import dataclasses
import datetime
import errno
import fcntl
import hashlib
import json
import math
import os
import shutil
import socket

import torch.distributed as dist

from million import checkpoint


def fingerprint(mcfg, shapes: dict, data: dict, tokenizer: str) -> dict:
    """What a checkpoint must share with this run to be resumed by it: the model (config and every parameter's
    full shape: world-independent), the data (source, split, seq_len, seed: `data`) and the tokenizer."""
    tok = tokenizer
    f = os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer
    if os.path.isfile(f):
        with open(f, "rb") as fh:
            tok = "sha256:" + hashlib.sha256(fh.read()).hexdigest()
    model = {k: v for k, v in dataclasses.asdict(mcfg).items() if k != "raw"}
    return {"model": model, "shapes": hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest(),
            "data": data, "tokenizer": tok}


def check_fingerprint(path: str, fp: dict):
    """Stop unless checkpoint path belongs to this run (compared on fp's parts: model, shapes, data, tokenizer)."""
    saved = checkpoint.read_manifest(path)["fingerprint"]
    saved = {k: v for k, v in saved.items() if k in fp}
    if isinstance(saved.get("model"), dict):  # fields this config does not have (a dense checkpoint written when
        # every config carried the MoE fields) are no difference: the parameters' shapes still are
        saved["model"] = {k: v for k, v in saved["model"].items() if k in fp["model"]}
    diff = checkpoint.fingerprint_mismatch(saved, fp)
    if diff:
        raise SystemExit(f"error: checkpoint {path} belongs to another run: {diff}. Use the same model, data and "
                         "tokenizer, or another --out_dir (or --resume none --overwrite true)")


def _none_left(root: str) -> str:
    return (f"error: no checkpoint in {root} verifies (each is named above and was moved aside as *.corrupt); to "
            "start the run over, use --resume none --overwrite true")


def published(out_dir: str, log) -> list[str]:
    """out_dir's checkpoints, newest first, whose files are all there at their sizes (the checksums come in
    load_newest); one that is not is named in one line and moved aside. What an interrupted save or deletion
    left is deleted. Stops if there were checkpoints and none is left."""
    root = os.path.join(out_dir, "checkpoints")
    checkpoint.clean_leftovers(root)
    steps, paths = sorted(checkpoint.list_steps(root), reverse=True), []
    for step in steps:
        path = checkpoint.step_dir(root, step)
        problem = checkpoint.verify(path, checksum=False)
        if problem is None:
            paths.append(path)
        else:
            log(f"warning: skipping checkpoint {path}: {problem}; {_set_aside(path)}")
    if steps and not paths:
        raise SystemExit(_none_left(root))
    return paths


def _set_aside(path: str) -> str:
    try:
        return f"moved aside to {os.path.basename(checkpoint.set_aside(path))}"
    except OSError as e:
        return f"it could not be moved aside ({e.strerror or e})"


def resume_candidates(out_dir: str, resume: str, overwrite: bool, fp: dict, log) -> list[str]:
    """The checkpoints to continue from, newest first (none: start fresh), after checking they belong to this
    run. resume: "auto" (out_dir's complete checkpoints, if any), "none", or a checkpoint folder. With "none"
    and overwrite, the earlier run stays until step 1 is done (begin deletes it)."""
    if resume == "none":
        earlier = [f for f in ("metrics.jsonl", "checkpoints") if os.path.exists(os.path.join(out_dir, f))]
        if earlier and not overwrite:
            raise SystemExit(f"error: --out_dir {out_dir} holds an earlier run ({', '.join(earlier)}); use "
                             "--resume auto to continue it, another --out_dir, or --overwrite true to replace it")
        return []
    if resume != "auto":
        problem = checkpoint.verify(resume, checksum=False)
        if problem:
            raise SystemExit(f"error: --resume {resume}: {problem}")
        paths = [resume]
    else:
        paths = published(out_dir, log)
    for path in paths:
        check_fingerprint(path, fp)
    return paths


def load_newest(paths: list[str], state: dict, device, log, exc=SystemExit, move_aside=True) -> tuple[str, dict]:
    """Collective (every rank, the same paths): fill `state` from the first of paths whose checksums verify and
    which loads. -> (its path, its trainer.json). One that fails is named in one line and moved aside (by rank
    0); without move_aside (a checkpoint named by --resume) it stops the run. exc (on every rank) if none is
    left."""
    for path in paths:
        try:
            return path, checkpoint.check_and_load(path, state, device)
        except checkpoint.Corrupt as e:
            if not move_aside:
                raise exc(f"error: --resume {path}: {e}") from None
            if dist.get_rank() == 0:
                log(f"warning: skipping checkpoint {path}: {e}; {_set_aside(path)}")
    raise exc(_none_left(os.path.dirname(paths[-1])))


def human_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def checkpoints_to_fit(out_dir: str, keep: int) -> int:
    """How many more checkpoints the disk must hold at once: keep + 1 (the kept ones and the next being written:
    pruning follows publishing), less those already there."""
    return max(1, keep + 1 - len(checkpoint.list_steps(os.path.join(out_dir, "checkpoints"))))


def check_outputs(needs: list[tuple[str, str, str, int, int]]):
    """Before the first step: for each (path, flag, what, bytes, copies), the folder is writable, not under a
    file, and its disk has room for `copies` of `what`, `bytes` each."""
    for path, flag, what, size, copies in needs:
        parent = os.path.abspath(path)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise SystemExit(f"error: {flag} {path}: {parent} is a file, not a folder; choose another {flag}")
        if not os.access(parent, os.W_OK):
            raise SystemExit(f"error: {flag} {path}: {parent} is not writable; choose another {flag}")
        free = shutil.disk_usage(parent).free
        if free < size * copies:
            many = (f", and {copies} more must fit at once (the kept ones beside the one being written): "
                    f"{human_bytes(size * copies)}; free space, lower --keep_checkpoints" if copies > 1 else
                    "; free space")
            raise SystemExit(f"error: {flag} {path}: {human_bytes(free)} free on its disk, but {what} needs about "
                             f"{human_bytes(size)}{many} or choose another {flag}")


class LineFile:
    """A log that only ever holds whole lines: each is one os.write on an O_APPEND descriptor, and one that fails
    (a full disk) is cut back to where the file ended and raised as one line naming the file and its size."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise checkpoint.write_error(path, 0, e) from None

    def write(self, text: str):
        data = text.encode()
        end = os.fstat(self.fd).st_size
        try:
            if os.write(self.fd, data) != len(data):  # a short write: the disk filled up during it
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, end)
            raise checkpoint.write_error(self.path, len(data), e) from None

    def close(self):
        os.close(self.fd)


class JsonlLog:
    """A JSONL log on rank 0 (metrics.jsonl, eval.jsonl): one JSON object per line. Opened for a run resumed
    after step `resumed_step`, it first drops the rows after that step, so a relaunch never writes a step twice.
    A non-finite value is written as null and named under "nonfinite" (bare NaN is not JSON)."""

    def __init__(self, path: str, resumed_step: int):
        rows = []
        if resumed_step and os.path.exists(path):
            with open(path) as fh:
                for line in fh:
                    try:
                        row = json.loads(line)
                    except ValueError:  # a line cut short by a kill
                        continue
                    if row.get("step", 0) <= resumed_step:
                        rows.append(line if line.endswith("\n") else line + "\n")
        checkpoint.write_file(path, "".join(rows).encode())
        self.file = LineFile(path)

    def write(self, rec: dict):
        bad = [k for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)]
        rec = {k: (None if k in bad else v) for k, v in rec.items()}
        if bad:
            rec["nonfinite"] = bad
        self.file.write(json.dumps(rec, allow_nan=False) + "\n")


# --- one writer per run folder -----------------------------------------------------------------------------

class Lock:
    """out_dir/lock, held (fcntl) by rank 0 of the run writing to out_dir, for the life of its process: a second
    launch into the same folder stops instead of racing the first for its checkpoints and logs. The OS releases
    the lock when its holder dies, however it dies, so a relaunch after a crash takes it over. The file names the
    holder (host, pid, start time) for the message the second launch prints. A folder that exists is locked at
    once; a new one is made and locked by take() once step 1 is done, so a start that fails leaves no folder
    (two new launches into one folder: the second to finish step 1 stops there)."""

    def __init__(self, out_dir: str):
        self.out_dir, self.path, self.fd = out_dir, os.path.join(out_dir, "lock"), None
        if os.path.isdir(out_dir):
            self.take()

    def take(self):
        if self.fd is not None:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise SystemExit(f"error: --out_dir {self.out_dir} is in use by {holder}; wait for it to end or stop "
                             "it, or use another --out_dir") from None
        self.fd = fd
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        holder = f"the run started {started} on host {socket.gethostname()}, pid {os.getpid()}\n".encode()
        try:
            os.ftruncate(fd, 0)
            os.write(fd, holder)
        except OSError as e:
            raise checkpoint.write_error(self.path, len(holder), e) from None

    def abandon(self):
        """A start that failed lets the folder go (a folder that was there keeps its lock file)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def lock_if_run(out_dir: str) -> "Lock | None":
    """The lock of a folder a run has used (it has a lock file), for a launch that only reads the run and adds
    to its eval.jsonl: it then never runs beside the run. A folder without one is left as it is."""
    return Lock(out_dir) if os.path.isfile(os.path.join(out_dir, "lock")) else None


def begin(out_dir: str, done: int, config: dict, launch: dict, lock: Lock) -> JsonlLog:
    """Once the first step has run, the run's files: out_dir made and locked if it is new; a fresh run (done 0)
    writes train_config.json, deletes an earlier run's checkpoints (--overwrite) and starts launches.jsonl and
    train.log anew; every launch adds a row to launches.jsonl (the step it continued from, what changed, its whole
    config). -> metrics.jsonl's log, cut back to step `done`."""
    lock.take()
    if done == 0:
        checkpoint.write_file(os.path.join(out_dir, "train_config.json"), json.dumps(config, indent=2).encode())
        root = os.path.join(out_dir, "checkpoints")
        for step in checkpoint.list_steps(root):  # what a checkpoint set aside as corrupt stays
            checkpoint.remove_dir(checkpoint.step_dir(root, step))
        for f in ("launches.jsonl", "train.log", "checkpoints/latest"):
            if os.path.exists(os.path.join(out_dir, f)):
                os.remove(os.path.join(out_dir, f))
    launches = LineFile(os.path.join(out_dir, "launches.jsonl"))
    try:
        launches.write(json.dumps({**launch, "config": config}) + "\n")
    finally:
        launches.close()
    return JsonlLog(os.path.join(out_dir, "metrics.jsonl"), done)
