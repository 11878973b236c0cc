"""The run's folder on disk: resumable checkpoints that are either complete or absent, never half-written; which
one a relaunch continues from; room for the outputs; the JSONL logs cut back to the step resumed.

    out_dir/checkpoints/step_0000120/   model + optimizer shards (torch.distributed.checkpoint: a file per rank,
                                        reloadable on any world size), trainer.json (step, data position, config),
                                        manifest.json (every file and its size, and the run's fingerprint)
    out_dir/checkpoints/latest          the name of the newest complete checkpoint (for people and scripts)

A checkpoint is written into step_N.tmp/, its files fsynced, the manifest written last, then the folder is
renamed to step_N/ and `latest` replaced (write, fsync, rename: each step atomic on a POSIX file system). A
crash at any point leaves the previous checkpoints as they were. Old checkpoints are deleted only after the new
one is published, and renamed to *.trash before deletion, so a half-deleted folder never has a checkpoint's name.
On resume the newest checkpoint whose files match its manifest is used; others are skipped with a message.

This file knows about files, not the model: train.py passes the state dicts, the trainer state and the
fingerprint (what must match for a checkpoint to belong to this run). Its own file because train.py is the loop,
and this is what a reader of "how does a run survive a kill?" needs, in one place. Exercised by
tests/test_long_runs.py (faults injected into real runs).
"""
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

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
    import torch.distributed.checkpoint as dcp
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
    """Every rank learns whether any rank failed (and rank 0's or the first message), so all stop together."""
    msgs = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, None if error is None else _first_line(error))
    failed = [m for m in msgs if m is not None]
    return None if not failed else (error if error is not None else RuntimeError(failed[0]))


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
    import torch.distributed.checkpoint as dcp
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:
        raise OSError(f"loading checkpoint {path} failed ({_first_line(e)})") from None
    with open(os.path.join(path, "trainer.json")) as fh:
        return json.load(fh)


# --- the run's folder: which checkpoint to continue from, room for outputs, the JSONL logs ----------------

def fingerprint(cfg, mcfg, shapes: dict, tokenizer: str) -> dict:
    """What a checkpoint must share with this run to be resumed by it: the model (config and every parameter's
    full shape: world-independent), the data source and the tokenizer."""
    tok = tokenizer
    f = os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer
    if os.path.isfile(f):
        with open(f, "rb") as fh:
            tok = "sha256:" + hashlib.sha256(fh.read()).hexdigest()
    # max_position_embeddings is left out: it is a label (RoPE is computed for the positions present), and
    # checkpoints from before YaRN set it to factor x original must still resume
    model = {k: v for k, v in dataclasses.asdict(mcfg).items() if k not in ("raw", "max_position_embeddings")}
    return {"model": model, "shapes": hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest(),
            "data": {k: getattr(cfg, k) for k in ("data", "data_repo", "data_revision", "data_split", "data_column",
                                                  "seq_len", "seed")},
            "tokenizer": tok}


def resume_point(cfg, fp: dict, log) -> str | None:
    """Rank 0: the checkpoint to continue from (None: start fresh), after checking it belongs to this run."""
    root = os.path.join(cfg.out_dir, "checkpoints")
    if cfg.resume == "none":
        earlier = [f for f in ("metrics.jsonl", "checkpoints") if os.path.exists(os.path.join(cfg.out_dir, f))]
        if earlier and not cfg.overwrite:
            raise SystemExit(f"error: --out_dir {cfg.out_dir} holds an earlier run ({', '.join(earlier)}); use "
                             "--resume auto to continue it, another --out_dir, or --overwrite true to replace it")
        if earlier:
            remove_dir(root)
        return None
    if cfg.resume != "auto":
        problem = verify(cfg.resume)
        if problem:
            raise SystemExit(f"error: --resume {cfg.resume}: {problem}")
        path = cfg.resume
    else:
        clean_leftovers(root)
        path = newest_valid(root, log)
        if path is None:
            return None
    diff = fingerprint_mismatch(read_manifest(path)["fingerprint"], fp)
    if diff:
        raise SystemExit(f"error: checkpoint {path} belongs to another run: {diff}. Use the same model, data and "
                         "tokenizer, or another --out_dir (or --resume none --overwrite true)")
    return path


def check_outputs(cfg, n_params: int, param_bytes: int, log):
    """Rank 0, before the first step: every output folder writable and not under a file, and free disk for a
    checkpoint (weights + two AdamW states, in param_dtype) and the export."""
    pbytes = param_bytes
    needs = [(cfg.out_dir, "--out_dir", 3 * n_params * pbytes)]
    if cfg.save_dir:
        needs.append((cfg.save_dir, "--save_dir", n_params * pbytes))
    for path, flag, size in needs:
        parent = os.path.abspath(path)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise SystemExit(f"error: {flag} {path}: {parent} is a file, not a folder; choose another {flag}")
        if not os.access(parent, os.W_OK):
            raise SystemExit(f"error: {flag} {path}: {parent} is not writable; choose another {flag}")
        free = shutil.disk_usage(parent).free
        if free < size * 1.05:  # 5%: the manifests, trainer.json, safetensors headers
            raise SystemExit(f"error: {flag} {path}: {free / 2**30:.2f} GiB free on its disk, but a "
                             f"{'checkpoint' if flag == '--out_dir' else 'export'} needs about {size / 2**30:.2f} "
                             f"GiB; free space or choose another {flag}")
    log(f"outputs: a checkpoint is about {3 * n_params * pbytes / 2**30:.2f} GiB; {cfg.keep_checkpoints} kept")


class Metrics:
    """out_dir/metrics.jsonl on rank 0: one JSON object per step. On resume the rows after the checkpoint's
    step are cut, so the file holds exactly one row per step. A non-finite value is written as null, and the
    row names it under "nonfinite" (bare NaN is not JSON)."""

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
