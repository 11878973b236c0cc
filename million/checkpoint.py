"""Checkpoints that are either complete or absent, never half-written.

    checkpoints/step_0000120/   model + optimizer shards (torch.distributed.checkpoint: a file per rank, reloadable
                                on any world size), trainer.json (step, data position, config), manifest.json (every
                                file, its size and its CRC-32 per 128 MiB, and the run's fingerprint)
    checkpoints/latest          the name of the newest complete checkpoint (for people and scripts)
    checkpoints/step_N.corrupt  a checkpoint that failed its check or its load, moved aside (kept, never counted)

A checkpoint is written into step_N.tmp/, its files fsynced, the manifest written last, then the folder is
renamed to step_N/ and `latest` replaced (write, fsync, rename: each step atomic on a POSIX file system). A
crash at any point leaves the previous checkpoints as they were. Old checkpoints are deleted only after the new
one is published, and renamed to *.trash first, so a half-deleted folder never has a checkpoint's name.
Each rank hashes the files it wrote right after writing them, so a later read can tell a changed byte from the
bytes written; verifying deals the files to the ranks by size, so hashing takes 1/world of the time.

This file knows about files, not the model or the trainer's flags: the caller passes the state dicts, the
trainer state and a fingerprint (what must match for a checkpoint to belong to a run). Which checkpoint a run
continues from is rundir.py's policy. Exercised by tests/e2e/test_long_runs.py and tests/test_checkpoint.py (faults
injected into real runs); bench/checksum_cost.py measures what the checksums cost.
"""
import concurrent.futures
import contextlib
import errno
import json
import os
import pickle
import re
import shutil
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor

import parallel

# What a checkpoint holds of the model: what trains (with LoRA the adapters alone, megabytes; the frozen base is
# read from --model again on resume), with its AdamW states
STATE = StateDictOptions(ignore_frozen_params=True, strict=False)
STEP_DIR = re.compile(r"^step_(\d{7,})$")
SEGMENT = 128 * 2**20  # a file's CRC-32 is kept per segment: the segments are hashed by threads in parallel
THREADS = 4            # zlib.crc32 releases the GIL: 1-2 GB/s per thread (bench/NOTES.md, checkpoint.py)
BLOCK = 8 * 2**20      # bytes read at a time
RECORD_BYTES = 2048    # per tensor a rank writes: torch.save's framing (~1.6 KB) and its entry in .metadata
MANIFEST_BYTES = 16 * 2**10  # trainer.json and manifest.json (8 KiB of checksums at Qwen3-8B on 8 ranks)


class Corrupt(Exception):
    """A checkpoint that failed its check or its load, raised on every rank at once; the message is one line."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:07d}")


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(n)} bytes"


def write_error(path: str, nbytes: int, e: OSError, fix="free space there or choose another --out_dir") -> OSError:
    """The one-line error for a write of nbytes to path that failed: the file, the room it needed, the room left."""
    try:
        free = f"its disk has {_size(shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free)} free"
    except OSError:
        free = "its disk cannot be read"
    return OSError(f"writing {path} failed ({e.strerror or e}): it needed {_size(nbytes)}, {free}; {fix}")


def write_file(path: str, data: bytes):
    """path holds data in full, or is as it was: written to path.tmp, fsynced, then renamed over path."""
    try:
        with open(path + ".tmp", "wb") as fh:
            if fh.write(data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(path + ".tmp", path)
    except OSError as e:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        raise write_error(path, len(data), e) from None


def _write_json(path: str, obj):
    write_file(path, json.dumps(obj, indent=1).encode())


def _fsync(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checksums(path: str, segment: int = SEGMENT) -> list[str]:
    """CRC-32 of each `segment` bytes of the file (hex), the segments hashed in parallel."""
    size = os.path.getsize(path)

    def crc(start: int) -> str:
        value, left, buf = 0, min(segment, size - start), bytearray(min(BLOCK, segment))
        with open(path, "rb", buffering=0) as fh:
            fh.seek(start)
            while left > 0:
                n = fh.readinto(memoryview(buf)[:min(left, len(buf))])
                if not n:
                    break  # the file shrank while read: the checksum then differs
                value, left = zlib.crc32(memoryview(buf)[:n], value), left - n
        return f"{value:08x}"
    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(crc, range(0, max(size, 1), segment)))


def state_bytes(state: dict, world: int) -> int:
    """About what save() writes for `state` over `world` ranks: every tensor's bytes and a record per rank that
    holds part of it (a DTensor's shard on each rank, a plain tensor once), the pickled values, the manifest."""
    total = MANIFEST_BYTES
    stack = [state]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)) and any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in x):
            stack.extend(x)
        elif isinstance(x, torch.Tensor):
            records = min(world, max(x.shape[0], 1)) if isinstance(x, DTensor) and x.dim() else 1
            total += x.numel() * x.element_size() + records * RECORD_BYTES
        else:
            total += len(pickle.dumps(x)) + RECORD_BYTES
    return total


def remove_dir(path: str):
    """Rename, then delete: a kill during the deletion leaves a *.trash folder, never a half checkpoint."""
    if not os.path.lexists(path):
        return
    trash = f"{path}.{os.getpid()}.trash"
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def set_aside(path: str) -> str:
    """Rename a checkpoint that failed to step_N.corrupt (or .corrupt2, ...): kept for a look, never loaded,
    pruned or counted; `latest` then names the newest one left (or is removed). -> the new path."""
    aside, n = f"{path}.corrupt", 1
    while os.path.lexists(aside):
        n += 1
        aside = f"{path}.corrupt{n}"
    os.replace(path, aside)
    root = os.path.dirname(path)
    left, latest = list_steps(root), os.path.join(root, "latest")
    with contextlib.suppress(OSError):  # for people and scripts only: the next save writes it anyway
        if left:
            _write_json(latest, {"checkpoint": os.path.basename(step_dir(root, left[-1])), "step": left[-1]})
        elif os.path.exists(latest):
            os.remove(latest)
    return aside


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
    error, _ = _shared_error(error)
    if error is None:
        try:
            dcp.save(state, checkpoint_id=tmp)  # each rank writes its own file, fsynced (FileSystemWriter's default)
        except (Exception, CheckpointException) as e:  # dcp gathers every rank's failure into one
            error = e                                    # CheckpointException (a BaseException), raised on all
    mine = {}
    if error is None:
        try:  # the files this rank wrote (FileSystemWriter names them __RANK_N.distcp), read back while cached
            mine = {f: checksums(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.startswith(f"__{rank}_")}
        except OSError as e:
            error = e
    error, sums = _shared_error(error, mine)  # every rank has written its shard before rank 0 publishes them
    if error is None and rank == 0:
        try:
            _write_json(os.path.join(tmp, "trainer.json"), trainer)
            crc = {f: c for part in sums for f, c in part.items()}
            files = {os.path.relpath(os.path.join(d, f), tmp): os.path.getsize(os.path.join(d, f))
                     for d, _, fs in os.walk(tmp) for f in fs}
            crc.update({f: checksums(os.path.join(tmp, f)) for f in files if f not in crc})  # .metadata, trainer.json
            _write_json(os.path.join(tmp, "manifest.json"), {"step": step, "files": files, "crc32": crc,
                                                             "segment_bytes": SEGMENT, "fingerprint": fingerprint})
            publish(tmp, final)
            _write_json(os.path.join(root, "latest"), {"checkpoint": os.path.basename(final), "step": step})
            for old in sorted(list_steps(root), reverse=True)[keep:]:
                remove_dir(step_dir(root, old))
        except Exception as e:
            error = e
    error, _ = _shared_error(error)
    if error is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        # A full disk does not always say so: torch's writer can fail first with "unexpected pos" on a short write
        last = list_steps(root)
        need = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(step_dir(root, last[-1]))
                   for f in fs) if last else state_bytes(state, dist.get_world_size())
        free = shutil.disk_usage(root).free
        what = "the last checkpoint's" if last else "a checkpoint's"
        full = (f"; its disk has {free / 2**20:.1f} MiB free, less than {what} {need / 2**20:.1f} "
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


def _shared_error(error, payload=None):
    """Every rank learns whether any rank failed (and rank 0's or the first message), so all stop together.
    -> (the error, every rank's payload)."""
    msgs = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, (None if error is None else _first_line(error), payload))
    failed = [m for m, _ in msgs if m is not None]
    error = None if not failed else (error if error is not None else RuntimeError(failed[0]))
    return error, [p for _, p in msgs]


def _agreed(problem: str | None, device) -> str | None:
    """Every rank learns whether any rank found a problem, and the first one's words (gathered only then)."""
    if not parallel.agree([problem is not None], device)[0]:
        return None
    msgs = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, problem)
    return next(m for m in msgs if m is not None)


def list_steps(root: str) -> list[int]:
    """Steps of the published checkpoints in root (by folder name; not yet verified)."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(root)) if m)


def read_manifest(path: str) -> dict:
    with open(os.path.join(path, "manifest.json")) as fh:
        return json.load(fh)


def read_trainer(path: str) -> dict | None:
    """trainer.json of checkpoint path (step, data position, config), or None if it cannot be read."""
    try:
        with open(os.path.join(path, "trainer.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _deal(sizes: dict, world: int) -> list[list[str]]:
    """Files dealt to ranks, largest first to the least loaded: the same on every rank."""
    shares, load = [[] for _ in range(world)], [0] * world
    for name in sorted(sizes, key=lambda f: (-sizes[f], f)):
        r = load.index(min(load))
        shares[r].append(name)
        load[r] += sizes[name]
    return shares


def verify(path: str, rank: int = 0, world: int = 1, checksum: bool = True) -> str | None:
    """None if every file the manifest lists is there with its size and, for this rank's share of the files
    (all of them for a world of 1), its checksum; else what is wrong (one line). A manifest written before
    checksums existed has sizes only: its load is then the check."""
    try:
        manifest = read_manifest(path)
        files, crc, segment = manifest["files"], manifest.get("crc32"), manifest.get("segment_bytes", SEGMENT)
        sizes = {name: int(size) for name, size in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"no readable manifest.json ({type(e).__name__})"
    for name, size in sizes.items():
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            return f"{name} is missing"
        if os.path.getsize(f) != size:
            return f"{name} has {os.path.getsize(f)} bytes, the manifest says {size}"
    if "trainer.json" not in files:
        return "trainer.json is not in the manifest"
    if not checksum or crc is None:
        return None
    for name in _deal(sizes, world)[rank]:
        if not isinstance(crc.get(name), list):
            return f"{name} has no checksum in the manifest"
        try:
            now = checksums(os.path.join(path, name), segment)
        except OSError as e:
            return f"{name} cannot be read ({e.strerror or e})"
        if now != crc[name]:
            i = next((i for i, (a, b) in enumerate(zip(now, crc[name])) if a != b), 0)
            return (f"{name} differs from the bytes written (the CRC-32 of its bytes {i * segment:,} to "
                    f"{min((i + 1) * segment, sizes[name]):,})")
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


def check_and_load(path: str, state: dict, device) -> dict:
    """Collective: every checksum verified (the files dealt to the ranks), then `state` (this rank's shards,
    resharded from any world size) filled from path. -> trainer.json. Raises Corrupt on every rank together if
    any rank found a problem or failed to load; `state` may then be partly overwritten."""
    problem = _agreed(verify(path, dist.get_rank(), dist.get_world_size()), device)
    if problem is None:
        try:
            dcp.load(state, checkpoint_id=path)
        except (Exception, CheckpointException) as e:
            problem = f"loading it failed ({_first_line(e)})"
        trainer = read_trainer(path)
        problem = _agreed(problem or (None if trainer else "trainer.json cannot be read"), device)
    if problem is not None:
        raise Corrupt(problem)
    return trainer
