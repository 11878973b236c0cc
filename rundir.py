"""The run's folder: what makes `--out_dir` one run that any relaunch continues.

    out_dir/lock                 held by the run writing here (one writer per folder)
    out_dir/train_config.json    the config the run started with
    out_dir/launches.jsonl       one row per launch: the step it continued from, what changed, its config
    out_dir/metrics.jsonl        one row per optimizer step, exactly once each (cut back to the step resumed)
    out_dir/eval.jsonl           one row per evaluation
    out_dir/train.log            what rank 0 printed, appended: the record when the terminal or the pipe is gone
    out_dir/checkpoints/         checkpoint.py's atomic checkpoints

This is the trainer's policy around checkpoint.py's mechanism: one writer per folder, which checkpoint a relaunch
continues from and whether it belongs to this run (the fingerprint), whether the outputs have room, and the
logs, written only once the first step has run (a start that fails changes no file). It runs on rank 0;
train.py shares its answers and errors with the other ranks.
"""
import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import json
import math
import os
import shutil
import socket

import checkpoint


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


def resume_point(out_dir: str, resume: str, overwrite: bool, fp: dict, log) -> str | None:
    """The checkpoint to continue from (None: start fresh), after checking it belongs to this run.
    resume: "auto" (the newest complete checkpoint in out_dir, if any), "none", or a checkpoint folder."""
    root = os.path.join(out_dir, "checkpoints")
    if resume == "none":
        earlier = [f for f in ("metrics.jsonl", "checkpoints") if os.path.exists(os.path.join(out_dir, f))]
        if earlier and not overwrite:
            raise SystemExit(f"error: --out_dir {out_dir} holds an earlier run ({', '.join(earlier)}); use "
                             "--resume auto to continue it, another --out_dir, or --overwrite true to replace it")
        if earlier:
            checkpoint.remove_dir(root)
        return None
    if resume != "auto":
        problem = checkpoint.verify(resume)
        if problem:
            raise SystemExit(f"error: --resume {resume}: {problem}")
        path = resume
    else:
        checkpoint.clean_leftovers(root)
        path = checkpoint.newest_valid(root, log)
        if path is None:
            return None
    diff = checkpoint.fingerprint_mismatch(checkpoint.read_manifest(path)["fingerprint"], fp)
    if diff:
        raise SystemExit(f"error: checkpoint {path} belongs to another run: {diff}. Use the same model, data and "
                         "tokenizer, or another --out_dir (or --resume none --overwrite true)")
    return path


def human_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_outputs(needs: list[tuple[str, str, str, int]]):
    """Before the first step: for each (path, flag, what, bytes), the folder is writable, not under a file, and
    its disk has room for `bytes` of `what` (+5% for manifests and headers)."""
    for path, flag, what, size in needs:
        parent = os.path.abspath(path)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise SystemExit(f"error: {flag} {path}: {parent} is a file, not a folder; choose another {flag}")
        if not os.access(parent, os.W_OK):
            raise SystemExit(f"error: {flag} {path}: {parent} is not writable; choose another {flag}")
        free = shutil.disk_usage(parent).free
        if free < size * 1.05:
            raise SystemExit(f"error: {flag} {path}: {human_bytes(free)} free on its disk, but {what} needs about "
                             f"{human_bytes(size)}; free space or choose another {flag}")


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
        with open(path + ".tmp", "w") as fh:
            fh.writelines(rows)
        os.replace(path + ".tmp", path)
        self.fh = open(path, "a")

    def write(self, rec: dict):
        bad = [k for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)]
        rec = {k: (None if k in bad else v) for k, v in rec.items()}
        if bad:
            rec["nonfinite"] = bad
        self.fh.write(json.dumps(rec, allow_nan=False) + "\n")
        self.fh.flush()


# --- one writer per run folder -----------------------------------------------------------------------------

class Lock:
    """out_dir/lock, held (fcntl) by rank 0 of the run writing to out_dir, for the life of its process: a second
    launch into the same folder stops at start instead of racing the first for its checkpoints and logs. The OS
    releases the lock when its holder dies, however it dies, so a relaunch after a crash takes it over. The file
    names the holder (host, pid, start time) for the message the second launch prints."""

    def __init__(self, out_dir: str):
        self.made_dir = not os.path.exists(out_dir)
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "lock")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(self.fd, 4096).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            raise SystemExit(f"error: --out_dir {out_dir} is in use by {holder}; wait for it to end or stop it, "
                             "or use another --out_dir") from None
        os.ftruncate(self.fd, 0)
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        os.write(self.fd, f"the run started {started} on host {socket.gethostname()}, pid {os.getpid()}\n".encode())

    def abandon(self):
        """A start that failed leaves no folder it made behind (a folder that was there keeps its lock file)."""
        if self.made_dir:
            os.remove(self.path)
            with contextlib.suppress(OSError):  # not empty: something else was written there meanwhile
                os.rmdir(os.path.dirname(self.path))
        os.close(self.fd)


def begin(out_dir: str, done: int, config: dict, launch: dict) -> JsonlLog:
    """Once the first step has run, the run's files: a fresh run (done 0) writes train_config.json and starts
    launches.jsonl and train.log anew; every launch adds a row to launches.jsonl (the step it continued from, what
    changed, its whole config). -> metrics.jsonl's log, cut back to step `done`."""
    os.makedirs(out_dir, exist_ok=True)
    if done == 0:
        with open(os.path.join(out_dir, "train_config.json.tmp"), "w") as fh:
            json.dump(config, fh, indent=2)
        os.replace(os.path.join(out_dir, "train_config.json.tmp"), os.path.join(out_dir, "train_config.json"))
        for f in ("launches.jsonl", "train.log"):
            if os.path.exists(os.path.join(out_dir, f)):
                os.remove(os.path.join(out_dir, f))
    with open(os.path.join(out_dir, "launches.jsonl"), "a") as fh:
        fh.write(json.dumps({**launch, "config": config}) + "\n")
    return JsonlLog(os.path.join(out_dir, "metrics.jsonl"), done)
