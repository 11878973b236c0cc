"""Nothing lost: checkpoints verified by their content, a start that fails or replaces a run, a full disk, the LR a
resumed run names, and --eval_only on a run's folder. Faults are injected at the same file size into real train.py
runs (torchrun, CPU, gloo); each test asserts what a user would lose (nothing) and what they are told (one line).
The writers and the checksums in-process: tests/test_checkpoint.py.

    python -m pytest tests/e2e/test_checkpoint.py -q
"""
import io
import json
import os
import re
import shutil
import signal
import subprocess

import pytest
import torch

from test_checkpoint import random_bytes
from .test_long_runs import reference  # noqa: F401  (the straight 8-step run, a fixture)
from .test_long_runs import assert_same_run, command, error_lines, launch, mount_small_disk, rows, steps, wait_for_rows

ARGS = ["--max_steps", "8", "--ckpt_every", "2"]  # reference's command
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Reference's command killed in step 7: checkpoints 4 and 6, metrics rows 1..6. Tests copy it."""
    out = tmp_path_factory.mktemp("killed") / "run"
    assert launch(2, out, *ARGS, fault="kill:1:7").returncode != 0
    assert steps(out) == [4, 6] and [r["step"] for r in rows(out)] == list(range(1, 7))
    return out


@pytest.fixture
def run_copy(killed, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(killed, out)
    return out


def record(ckpt, fqn: str, file: str) -> tuple[int, bytes]:
    """(offset in `file`, bytes) of the record of tensor fqn that checkpoint folder ckpt holds there."""
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(str(ckpt)).read_metadata()
    [info] = [i for k, i in md.storage_data.items() if k.fqn == fqn and i.relative_path == file]
    with open(ckpt / file, "rb") as fh:
        fh.seek(info.offset)
        return info.offset, fh.read(info.length)


def overwrite(path, offset: int, data: bytes):
    """Bytes replaced in place: the file keeps its size."""
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)
    assert os.path.getsize(path) == size


def flip_weight_bytes(ckpt, n=64):
    """n bytes inverted inside the values of layers.0.self_attn.q_proj.weight in __0_0.distcp."""
    offset, raw = record(ckpt, "model.layers.0.self_attn.q_proj.weight", "__0_0.distcp")
    values = torch.load(io.BytesIO(raw)).numpy().tobytes()
    at = offset + raw.index(values) + 128
    with open(ckpt / "__0_0.distcp", "rb") as fh:
        fh.seek(at)
        old = fh.read(n)
    overwrite(ckpt / "__0_0.distcp", at, bytes(b ^ 0xFF for b in old))


def warnings_of(p) -> list[str]:
    return [line for line in p.stdout.splitlines() if line.startswith("warning: skipping checkpoint")]


def assert_fell_back(p, out, reference, problem: str):
    """One line named step 6 and its problem, step 6 was moved aside, the run resumed from step 4 and equals the
    straight run."""
    assert p.returncode == 0, p.stderr[-3000:]
    [line] = warnings_of(p)
    assert "step_0000006" in line and problem in line and "moved aside to step_0000006.corrupt" in line, line
    assert "resumed from" in p.stdout and "step_0000004 after step 4" in p.stdout
    assert not error_lines(p)
    assert (out / "checkpoints" / "step_0000006.corrupt" / "manifest.json").is_file()
    assert json.loads((out / "checkpoints" / "latest").read_text())["checkpoint"] == "step_0000008"
    assert_same_run(rows(out), reference)
    # the corrupt one is never counted as kept: --keep_checkpoints 2 still keeps two good ones
    assert steps(out) == [6, 8] and "step_0000006.corrupt" in os.listdir(out / "checkpoints")


def test_flipped_weight_bytes_fall_back_to_the_checkpoint_before(run_copy, reference):
    flip_weight_bytes(run_copy / "checkpoints" / "step_0000006")
    p = launch(2, run_copy, *ARGS)
    assert_fell_back(p, run_copy, reference, "__0_0.distcp differs from the bytes written")


def test_a_corrupt_pickled_header_falls_back_to_the_checkpoint_before(run_copy, reference):
    """200 random bytes in .metadata (the pickled index of every tensor), at the same size."""
    md = run_copy / "checkpoints" / "step_0000006" / ".metadata"
    overwrite(md, os.path.getsize(md) // 2, random_bytes(200, 0))
    p = launch(2, run_copy, *ARGS)
    assert_fell_back(p, run_copy, reference, ".metadata differs from the bytes written")


def test_a_checkpoint_without_checksums_that_fails_to_load_falls_back(run_copy, reference):
    """A checkpoint written before checksums (its manifest has sizes only) with 200 KB of random bytes over the
    pickled headers at the start of __1_0.distcp: its load raises on every rank, and that is the check."""
    ckpt = run_copy / "checkpoints" / "step_0000006"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["crc32"], manifest["segment_bytes"]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    overwrite(ckpt / "__1_0.distcp", 0, random_bytes(200 * 1024, 1))
    p = launch(2, run_copy, *ARGS)
    assert_fell_back(p, run_copy, reference, "loading it failed")


def test_no_checkpoint_that_verifies_stops_and_keeps_the_run(run_copy):
    """Both checkpoints corrupt: one line each, both moved aside, then one error line; no fresh start over the
    run's files."""
    before = (run_copy / "metrics.jsonl").read_text()
    flip_weight_bytes(run_copy / "checkpoints" / "step_0000006")
    flip_weight_bytes(run_copy / "checkpoints" / "step_0000004")
    p = launch(2, run_copy, *ARGS)
    lines = error_lines(p)
    assert p.returncode != 0 and len(lines) == 1 and "no checkpoint in" in lines[0], p.stderr[-3000:]
    assert "--resume none --overwrite true" in lines[0] and len(warnings_of(p)) == 2
    assert sorted(os.listdir(run_copy / "checkpoints")) == ["step_0000004.corrupt", "step_0000006.corrupt"]
    assert (run_copy / "metrics.jsonl").read_text() == before


def test_overwrite_deletes_the_old_run_only_once_step_one_is_done(run_copy, reference, tmp_path):
    """--resume none --overwrite true whose start then fails (data too short for one window, found when step 1
    reads it): the old run is all there, and its own command continues it."""
    before = {f: (run_copy / f).read_bytes() for f in ("metrics.jsonl", "launches.jsonl", "train.log")}
    (tmp_path / "short.txt").write_text("too short for a window")
    p = launch(2, run_copy, *ARGS, "--resume", "none", "--overwrite", "true", "--data", str(tmp_path / "short.txt"))
    assert p.returncode != 0 and "before step 1" in p.stderr, p.stderr[-3000:]
    assert steps(run_copy) == [4, 6] and before == {f: (run_copy / f).read_bytes() for f in before}
    p = launch(2, run_copy, *ARGS)
    assert p.returncode == 0 and "after step 6" in p.stdout, p.stderr[-3000:]
    assert_same_run(rows(run_copy), reference)


def test_a_failed_start_leaves_no_new_folder_and_keeps_an_old_one(tmp_path):
    """Two ranks, a start that fails at step 1: no folder is made for it; a folder that was there stays, with
    what it held."""
    (tmp_path / "short.txt").write_text("too short for a window")
    p = launch(2, tmp_path / "fresh", "--data", str(tmp_path / "short.txt"))
    assert p.returncode != 0 and not (tmp_path / "fresh").exists(), p.stderr[-3000:]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "notes.txt").write_text("mine")
    p = launch(2, tmp_path / "old", "--data", str(tmp_path / "short.txt"))
    assert p.returncode != 0 and (tmp_path / "old" / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path / "old")) == ["lock", "notes.txt"]


def lr_line(p) -> tuple[int, str]:
    [m] = re.findall(r"the LR schedule continues at step (\d+) with (\S+?),", p.stdout)
    return int(m[0]), m[1]


def test_the_resume_message_names_the_lr_applied_next(run_copy):
    """--max_steps raised mid-cosine (6 of 8 -> 12), then on the finished run (12 -> 14): the message names the
    LR that the next step's metrics row shows."""
    p = launch(2, run_copy, "--max_steps", "12", "--ckpt_every", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    step, lr = lr_line(p)
    assert step == 7 and lr == f"{rows(run_copy)[6]['lr']:.3g}", (lr, rows(run_copy)[5:8])
    p = launch(2, run_copy, "--max_steps", "14", "--ckpt_every", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    step, lr = lr_line(p)
    assert step == 13 and lr == f"{rows(run_copy)[12]['lr']:.3g}" == "0.0003", (lr, rows(run_copy)[11:])


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """4 steps on 2 ranks, evaluated before step 1 and after step 4; a checkpoint at the end."""
    out = tmp_path_factory.mktemp("eval") / "run"
    p = launch(2, out, "--max_steps", "4", "--eval_every", "4")
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def test_eval_only_evaluates_the_newest_checkpoint_of_the_run(evaluated):
    """--eval_only true on the run's folder: the trained weights (the loss of the run's last evaluation), not a
    random model's (its evaluation before step 1); one line names the checkpoint; the row has its step."""
    first, last = [json.loads(x) for x in open(evaluated / "eval.jsonl")]
    assert first["step"] == 0 and last["step"] == 4 and last["loss"] < first["loss"] - 0.1
    p = launch(2, evaluated, "--max_steps", "4", "--eval_only", "true")
    assert p.returncode == 0, p.stderr[-3000:]
    said = [x for x in p.stdout.splitlines() if x.startswith("eval only:")]
    assert len(said) == 1 and "checkpoint " in said[0] and "step_0000004 (step 4" in said[0], p.stdout
    row = [json.loads(x) for x in open(evaluated / "eval.jsonl")][-1]
    assert row["step"] == 4 and row["loss"] == pytest.approx(last["loss"], rel=1e-6, abs=0)
    assert row["loss_by_position"] == pytest.approx(last["loss_by_position"], rel=1e-6, abs=0)


def test_eval_only_refuses_a_live_run(tmp_path):
    out = tmp_path / "run"
    live = subprocess.Popen(command(2, out, "--max_steps", "100000", "--ckpt_every", "1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        wait_for_rows(out, 2, live)
        p = launch(1, out, "--eval_only", "true")
        assert live.poll() is None, "the live run ended"
    finally:
        live.send_signal(signal.SIGTERM)
        live.communicate(timeout=120)
    lines = error_lines(p)
    assert p.returncode != 0 and len(lines) == 1 and "is in use by the run started" in lines[0], p.stderr[-3000:]
    assert not (out / "eval.jsonl").exists()


@pytest.fixture
def tiny_disk(tmp_path):
    yield mount_small_disk(tmp_path / "disk", "200k")
    subprocess.run(["umount", "-l", str(tmp_path / "disk")])


def test_a_full_disk_is_named_in_one_line_and_no_log_holds_half_a_line(tiny_disk):
    """--checkpoints false with 40 KB free: the run stops when its logs fill the disk, with one line naming the
    file and the room it needed; metrics.jsonl and train.log end with a whole line."""
    (tiny_disk / "filler").write_bytes(b"\0" * (200 * 1024 - 40 * 1024))
    out = tiny_disk / "run"
    p = launch(1, out, "--max_steps", "1000", "--checkpoints", "false", "--ckpt_every_min", "0")
    lines = error_lines(p)
    assert p.returncode != 0 and len(lines) == 1, p.stderr[-3000:]
    assert re.search(r"writing \S+/run/(metrics\.jsonl|train\.log) failed \(No space left on device\): it needed "
                     r"\d+ bytes", lines[0]) and "free space" in lines[0], lines[0]
    metrics = (out / "metrics.jsonl").read_text()
    assert metrics.endswith("\n") and [json.loads(x)["step"] for x in metrics.splitlines()] == list(
        range(1, len(metrics.splitlines()) + 1))
    log = (out / "train.log").read_text()
    assert log.endswith("\n") and all(x.startswith(("config:", "world", "fit:", "model:", "outputs:", "time to",
                                                    "step ", "error")) for x in log.splitlines()), log[-500:]


def test_the_start_check_counts_the_kept_checkpoints_and_the_next(tmp_path):
    """A disk with room for two of the tiny model's checkpoints (1.7 MiB each) but not three: --keep_checkpoints 2
    (two kept beside the one being written) stops before step 1 in one line; --keep_checkpoints 1 trains."""
    disk = mount_small_disk(tmp_path / "disk", "4600k")
    try:
        p = launch(2, disk / "run", "--max_steps", "4", "--ckpt_every", "2")
        lines = error_lines(p)
        assert p.returncode != 0 and len(lines) == 1 and "3 more must fit at once" in lines[0], lines
        assert "lower --keep_checkpoints" in lines[0] and not (disk / "run").exists()
        p = launch(2, disk / "run", "--max_steps", "6", "--ckpt_every", "2", "--keep_checkpoints", "1")
        assert p.returncode == 0, p.stderr[-3000:]
        assert steps(disk / "run") == [6]
    finally:
        subprocess.run(["umount", "-l", str(disk)])
