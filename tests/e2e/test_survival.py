"""Runs that survive their surroundings: a lost terminal, a dead log pipe, a frozen peer, a second launch into the
same folder, flags changed on resume, a failed start, a data error mid-run. Each fault is done to a real run
(torchrun, CPU, gloo) and the test asserts what a user would lose: nothing, or one clear line."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from .test_long_runs import ROOT, TINY, assert_same_run, command, launch, rows, steps, wait_for_rows

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """12 uninterrupted steps on 2 ranks: what every interrupted run below must equal."""
    out = tmp_path_factory.mktemp("straight") / "run"
    p = launch(2, out, "--max_steps", "12")
    assert p.returncode == 0, p.stderr[-3000:]
    return rows(out)


def children(pid: int) -> list[int]:
    """The processes whose parent is pid (from /proc)."""
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def rank_of(pid: int) -> int:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
    return int(env[b"RANK"])


def test_sighup_saves_and_the_relaunch_continues(tmp_path, straight):
    """A lost terminal (SIGHUP to torchrun, as an ssh drop sends it): the workers finish the step, save and stop;
    the same command continues, and the run equals the straight one."""
    out = tmp_path / "run"
    proc = subprocess.Popen(command(2, out, "--max_steps", "12"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, start_new_session=True)
    wait_for_rows(out, 3, proc)
    proc.send_signal(signal.SIGHUP)
    stdout, stderr = proc.communicate(timeout=60)
    stopped = rows(out)[-1]["step"]
    assert "SIGHUP" in stdout and steps(out)[-1] == stopped < 12, stdout[-2000:] + stderr[-2000:]
    p = launch(2, out, "--max_steps", "12")
    assert p.returncode == 0 and f"after step {stopped}" in p.stdout, p.stderr[-3000:]
    assert_same_run(rows(out), straight)


def test_a_signal_to_one_worker_stops_every_rank_and_rank_0_names_it(tmp_path):
    """SIGUSR1 to rank 1 alone (a scheduler that signals one process): every rank saves after the same step and
    stops, and rank 0's line names the signal and where it came from."""
    out = tmp_path / "run"
    proc = subprocess.Popen(command(2, out, "--max_steps", "100000"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        wait_for_rows(out, 3, proc)
        os.kill({rank_of(pid): pid for pid in children(proc.pid)}[1], signal.SIGUSR1)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    stopped = rows(out)[-1]["step"]
    assert f"stopping after step {stopped} (SIGUSR1, on another rank)" in stdout, stdout[-2000:] + stderr[-2000:]
    assert steps(out)[-1] == stopped


def test_a_closed_output_pipe_neither_kills_nor_stops_the_run(tmp_path, straight):
    """The reader of stdout goes away after 3 lines (`| head -3`, a killed tee): the run trains to the end, and
    out_dir/train.log holds every line."""
    out = tmp_path / "run"
    proc = subprocess.Popen(command(2, out, "--max_steps", "12"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=ENV)
    for _ in range(3):
        proc.stdout.readline()
    proc.stdout.close()  # the pipe's read end is gone: the next write to it fails
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    assert_same_run(rows(out), straight)
    log = open(out / "train.log").read()
    assert "step   12/12 [" in log and "config: preset demo" in log and "Traceback" not in stderr.decode()


def test_head_in_a_shell_pipeline(tmp_path):
    out = tmp_path / "run"
    cmd = " ".join(command(2, out, "--max_steps", "6")) + " | head -3"
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=ENV, timeout=180)
    assert len(p.stdout.splitlines()) == 3 and [r["step"] for r in rows(out)] == list(range(1, 7)), p.stderr[-2000:]


def test_a_frozen_peer_ends_every_other_rank_within_a_minute(tmp_path):
    """Rank 1 freezes (SIGSTOP) mid-run: rank 0, waiting for it in a collective, says so in one line and exits
    within 60 s instead of waiting for the 30-minute collective timeout; nothing is left running (torchrun ends
    the frozen one, SIGKILL after its own 30 s grace), and the checkpoints written before are intact."""
    out = tmp_path / "run"
    proc = subprocess.Popen(command(2, out, "--max_steps", "100000", "--ckpt_every", "2"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    wait_for_rows(out, 3, proc)
    workers = {rank_of(pid): pid for pid in children(proc.pid)}
    os.kill(workers[1], signal.SIGSTOP)
    t0 = time.time()
    try:
        while alive(workers[0]) and time.time() - t0 < 90:
            time.sleep(0.2)
        ended = time.time() - t0
        stdout, stderr = proc.communicate(timeout=120)  # torchrun ends the frozen one (SIGKILL after its grace)
    finally:
        for pid in workers.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert ended < 60, ended
    assert "rank 1 has not answered" in stderr, stderr[-3000:]
    assert not any(alive(pid) for pid in workers.values()) and proc.returncode != 0
    last = steps(out)[-1]
    assert last >= 2 and os.path.isfile(out / "checkpoints" / f"step_{last:07d}" / "manifest.json")


def test_a_second_launch_into_a_running_folder_stops_with_one_line(tmp_path):
    """A requeued job starts while the first still runs: the second stops at once, naming the holder; the first
    goes on undisturbed: one metrics row per step, its checkpoints its own."""
    out = tmp_path / "run"
    first = subprocess.Popen(command(2, out, "--max_steps", "100000", "--ckpt_every", "1"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=ENV)
    wait_for_rows(out, 2, first)
    second = launch(2, out, "--max_steps", "100000", "--ckpt_every", "1")
    assert first.poll() is None, "the first run ended"
    first.send_signal(signal.SIGTERM)
    _, stderr = first.communicate(timeout=120)
    lines = [x for x in second.stderr.splitlines() if x.startswith("error")]
    assert second.returncode != 0 and len(lines) == 1 and "is in use by the run started" in lines[0], second.stderr
    assert f"pid {first.pid}," not in lines[0] and "pid" in lines[0]  # the holder is rank 0, not torchrun
    done = rows(out)[-1]["step"]
    assert [r["step"] for r in rows(out)] == list(range(1, done + 1)) and steps(out)[-1] == done, stderr[-2000:]
    launches = [json.loads(x) for x in open(out / "launches.jsonl")]
    assert len(launches) == 1  # the second launch wrote nothing


def test_a_dead_holders_lock_is_taken_over(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "lock").write_text("the run started 2026-01-01T00:00:00 on host gone, pid 1\n")  # nobody holds it
    p = launch(1, out, "--max_steps", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"pid" in (out / "lock").read_text() and "host gone" not in (out / "lock").read_text()


def test_flags_changed_on_resume_are_named_and_the_lr_does_not_jump(tmp_path):
    """Raising --max_steps and changing --lr on a finished run: one line names both changes; the LR continues
    from where the run was (no cosine recomputed over the new length); train_config.json still describes the
    first launch and launches.jsonl holds both."""
    out = tmp_path / "run"
    assert launch(1, out, "--max_steps", "6").returncode == 0
    first_cfg = (out / "train_config.json").read_text()
    p = launch(1, out, "--max_steps", "10", "--lr", "6e-3")
    assert p.returncode == 0, p.stderr[-3000:]
    changed = [x for x in p.stdout.splitlines() if x.startswith("changed since")]
    assert len(changed) == 1 and "--max_steps 6 -> 10" in changed[0] and "--lr 0.003 -> 0.006" in changed[0]
    lrs = [r["lr"] for r in rows(out)]
    floor = 3e-3 * 0.1
    assert lrs[5] == pytest.approx(floor) and all(x == pytest.approx(2 * floor) for x in lrs[6:]), lrs
    assert (out / "train_config.json").read_text() == first_cfg
    launches = [json.loads(x) for x in open(out / "launches.jsonl")]
    assert [x["from_step"] for x in launches] == [0, 6] and launches[1]["changes"]["lr"] == [3e-3, 6e-3]


def test_a_fixed_flag_changed_on_resume_is_refused(tmp_path):
    out = tmp_path / "run"
    assert launch(1, out, "--max_steps", "2").returncode == 0
    p = launch(1, out, "--max_steps", "4", "--param_dtype", "bfloat16")
    lines = [x for x in p.stderr.splitlines() if x.startswith("error")]
    assert p.returncode != 0 and len(lines) == 1 and "--param_dtype float32" in lines[0], p.stderr[-2000:]


def test_a_failed_start_changes_no_file(tmp_path):
    """A start that fails after the folder was taken (here: --save_dir under a file) leaves every file of the
    earlier run as it was, and creates no folder for a new run."""
    out = tmp_path / "run"
    assert launch(1, out, "--max_steps", "2").returncode == 0
    before = {f: (out / f).read_bytes() for f in os.listdir(out) if (out / f).is_file() and f != "lock"}
    (tmp_path / "file").write_text("x")
    p = launch(1, out, "--max_steps", "4", "--save_dir", str(tmp_path / "file" / "export"))
    assert p.returncode != 0 and "is a file, not a folder" in p.stderr
    after = {f: (out / f).read_bytes() for f in os.listdir(out) if (out / f).is_file() and f != "lock"}
    assert before == after
    fresh = tmp_path / "fresh"
    p = launch(1, fresh, "--max_steps", "4", "--save_dir", str(tmp_path / "file" / "export"))
    assert p.returncode != 0 and not fresh.exists()


def test_a_start_that_fails_at_step_one_writes_no_evaluation(tmp_path):
    """The evaluation before step 1 (--eval_every, with the retrieval test) is held until step 1 is done: a run
    killed in its first step leaves no folder behind, eval.jsonl and retrieval.jsonl included."""
    out = tmp_path / "run"
    p = launch(1, out, "--max_steps", "2", "--eval_every", "1", "--eval_sequences", "1", "--retrieval", "true",
               "--retrieval_depths", "0.5", "--retrieval_keys", "1", fault="kill:0:1")
    assert p.returncode != 0 and "retrieval    0 | exact match" in p.stderr + p.stdout, p.stderr[-3000:]
    assert not out.exists(), sorted(os.listdir(out))


def test_a_data_error_mid_run_saves_first_and_names_the_file(tmp_path):
    """A file that is not text, reached at step 3: the steps before it are saved, and one line names the file."""
    books = tmp_path / "books"
    books.mkdir()
    for i in range(3):
        (books / f"a{i}.txt").write_text(("It was the best of times, it was the worst of times. " * 6)[: 260])
    (books / "b.txt").write_bytes(bytes(range(128, 256)) * 4)
    out = tmp_path / "run"
    p = launch(1, out, "--max_steps", "10", "--data", str(books))
    lines = [x for x in p.stderr.splitlines() if x.startswith("error")]
    assert p.returncode != 0 and len(lines) == 1 and "b.txt" in lines[0], p.stderr[-3000:]
    done = rows(out)[-1]["step"]
    assert steps(out)[-1] == done >= 1 and "checkpoint of step" in lines[0]
    assert root_cause(p) == lines[0], p.stderr[-3000:]


def root_cause(p) -> str:
    """The cause torchrun's summary of a failed run names last (its "Root Cause" block's traceback line)."""
    return p.stderr.rsplit("Root Cause", 1)[-1].split("traceback : ", 1)[-1].splitlines()[0]


def test_unknown_flag_says_what_was_meant_once(tmp_path):
    p = subprocess.run(command(2, tmp_path / "run", "--max_step", "3"), capture_output=True, text=True, env=ENV,
                       timeout=120)
    lines = [x for x in p.stderr.splitlines() if x.startswith("error")]
    assert p.returncode != 0 and lines == ["error: --max_step: unknown flag; did you mean --max_steps? "
                                           "(python train.py --help lists every flag)"], p.stderr[-2000:]
    assert root_cause(p) == lines[0], p.stderr[-2000:]  # not torchrun's link to its docs
    assert "message format" not in p.stderr, p.stderr[-2000:]  # our error file read as torch's own @record writes it


def test_help_and_a_short_config_line(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "--max_steps 20" in p.stdout and "--offload_layers -1" in p.stdout
    # with a preset, its values
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", "demo", "--help"],
                       capture_output=True, text=True)
    assert p.returncode == 0 and "--max_steps 150" in p.stdout and "--model tiny" in p.stdout, p.stderr[-2000:]
    p = launch(1, tmp_path / "run", "--max_steps", "1")
    config = next(x for x in p.stdout.splitlines() if x.startswith("config:"))
    # short but for the run folder's path, named twice (pytest's tmp_path is longer under some runners)
    assert len(config.replace(str(tmp_path / "run"), "RUN")) < 200 and "--max_steps 1" in config, config
    assert "K parameters" in p.stdout and "MiB; 2 kept" in p.stdout, p.stdout
