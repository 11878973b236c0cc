"""Long runs survive: faults injected into real train.py runs (torchrun, CPU, gloo), then the same command again.

Each fault is checked for what a user would lose: the losses and grad norms of the continued run must equal an
uninterrupted run's exactly, metrics.jsonl must hold one row per step, the earlier checkpoint must be intact, and
a bad input must stop every rank with one line that says what to change. tests/e2e/fault_run.py injects the faults.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--config", "demo", "--seq_len", "264", "--loss_chunk", "100", "--warmup_steps", "2", "--lr", "3e-3"]


def command(nproc, out, *args, script="train.py", restarts=0):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            f"--max-restarts={restarts}", os.path.join(ROOT, script), *TINY, "--out_dir", str(out), *args]


def launch(nproc, out, *args, fault=None, restarts=0, timeout=180):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if fault:
        env["FAULT"] = fault
    script = "tests/e2e/fault_run.py" if fault else "train.py"
    return subprocess.run(command(nproc, out, *args, script=script, restarts=restarts), capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=str(out.parent))


def rows(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def steps(out):
    return sorted(int(d[5:]) for d in os.listdir(out / "checkpoints") if d.startswith("step_") and "." not in d)


def assert_same_run(a, b):
    """Exactly the same steps, losses and grad norms (bit for bit: resume restores every state exactly)."""
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, len(a) + 1))
    assert [(r["loss"], r["grad_norm"]) for r in a] == [(r["loss"], r["grad_norm"]) for r in b]


def error_lines(p):
    """The lines train.py printed as errors, with no traceback from train.py's code."""
    assert 'train.py", line' not in p.stderr and "checkpoint.py\", line" not in p.stderr, p.stderr[-3000:]
    return [line for line in (p.stdout + p.stderr).splitlines() if line.startswith("error")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """8 uninterrupted steps on 2 ranks, a checkpoint every 2."""
    out = tmp_path_factory.mktemp("ref") / "run"
    p = launch(2, out, "--max_steps", "8", "--ckpt_every", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    return rows(out)


@pytest.mark.parametrize("fault,kept", [("kill:1:5", [2, 4]), ("kill_in_save:1:4", [2]), ("kill_in_save:0:4", [2]),
                                        ("kill_in_delete:0:6", [4, 6])])
def test_a_killed_run_continues_exactly(tmp_path, reference, fault, kept):
    """SIGKILL of one rank mid-step, inside a checkpoint write (its shard written, the manifest not), or while
    the oldest checkpoint is half deleted; then the same command again."""
    out = tmp_path / "run"
    args = ["--max_steps", "8", "--ckpt_every", "2"]
    p = launch(2, out, *args, fault=fault)
    assert p.returncode != 0
    if fault == "kill:1:5":  # the survivor names the rank that died without a word
        assert "error (rank 0): rank 1 died without a message (killed, or out of host memory)" in p.stderr, \
            p.stderr[-3000:]
    assert steps(out) == kept  # the earlier checkpoints are intact
    p = launch(2, out, *args)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"after step {kept[-1]}" in p.stdout
    assert_same_run(rows(out), reference)
    # --keep_checkpoints 2; no half-written (.tmp) or half-deleted (.trash) folder is left
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_0000006", "step_0000008"]


def test_torchrun_restart_resumes_by_itself(tmp_path, reference):
    """torchrun --max-restarts 1: a worker killed mid-step; torchrun restarts the workers, which resume. (The
    restarted workers must not read their predecessors' addresses from torchrun's store: train.py prefixes the
    store per attempt. Without it, a restart failed to connect in about half the runs here.)"""
    out = tmp_path / "run"
    p = launch(2, out, "--max_steps", "8", "--ckpt_every", "2", fault="kill:0:3", restarts=1)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stdout and "after step 2" in p.stdout
    assert_same_run(rows(out), reference)


def wait_for_rows(out, n, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if os.path.exists(out / "metrics.jsonl") and len(open(out / "metrics.jsonl").readlines()) >= n:
            return
        assert proc.poll() is None, "the run ended early"
        time.sleep(0.05)
    raise TimeoutError


def test_sigterm_saves_and_exits_75_then_the_run_continues(tmp_path):
    """SIGTERM (a scheduler's notice) to a plain `python train.py`: the step in flight ends, a checkpoint is
    written, the exit code is 75; the same command continues from there, one metrics row per step."""
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *TINY, "--out_dir", str(out), "--max_steps"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd + ["400"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_for_rows(out, 3, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75, stderr[-3000:]
    stopped = rows(out)[-1]["step"]
    assert steps(out)[-1] == stopped and "stopping after step" in stdout and "SIGTERM" in stdout
    p = subprocess.run(cmd + [str(stopped + 2)], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["step"] for r in rows(out)] == list(range(1, stopped + 3))


def test_sigterm_without_checkpoints_says_none_was_written(tmp_path):
    """The same with --checkpoints false: it stops at the step boundary with exit code 75, and its line says that
    nothing was saved (not "relaunch to continue", which would start over)."""
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *TINY, "--out_dir", str(out), "--max_steps", "400",
           "--checkpoints", "false"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    wait_for_rows(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75, stderr[-3000:]
    line = [x for x in stdout.splitlines() if x.startswith("stopping after step")]
    assert line == [f"stopping after step {rows(out)[-1]['step']} (SIGTERM), with no checkpoint (--checkpoints false). "
                    "Exit code 75"], stdout[-2000:]
    assert not os.path.exists(out / "checkpoints") or not os.listdir(out / "checkpoints")


def test_sigterm_to_torchrun_stops_every_rank_with_a_checkpoint(tmp_path):
    """torchrun passes SIGTERM on to its workers, which agree, save and exit."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command(2, out, "--max_steps", "400"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    wait_for_rows(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0
    stopped = rows(out)[-1]["step"]
    assert steps(out)[-1] == stopped and "stopping after step" in stdout, stdout[-2000:] + stderr[-2000:]


def test_workers_of_a_killed_launcher_stop(tmp_path):
    """torchrun killed with SIGKILL: its workers save and exit instead of training on as orphans."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command(2, out, "--max_steps", "100000"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    wait_for_rows(out, 2, proc)
    workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                              text=True).stdout.split()]
    assert len(workers) == 2
    proc.kill()
    proc.wait()
    t0 = time.time()
    while any(os.path.exists(f"/proc/{w}") and "zombie" not in open(f"/proc/{w}/status").read() for w in workers):
        assert time.time() - t0 < 60, "workers still running after their launcher died"
        time.sleep(0.1)
    assert steps(out)[-1] == rows(out)[-1]["step"]  # they saved where they stopped


def test_a_nan_gradient_skips_the_step_and_changes_no_weight(tmp_path):
    """A NaN in one gradient at step 3: the step is skipped and logged (null, not NaN, in valid JSON), and the
    exported weights equal those of a run that stopped after step 2 (constant lr, so the runs share a schedule)."""
    const = ["--warmup_steps", "0", "--min_lr_ratio", "1"]
    p = launch(2, tmp_path / "two", "--max_steps", "2", "--save_dir", str(tmp_path / "hf2"), *const)
    assert p.returncode == 0, p.stderr[-3000:]
    p = launch(2, tmp_path / "nan", "--max_steps", "3", "--save_dir", str(tmp_path / "hf3"), *const, fault="nan:3")
    assert p.returncode == 0, p.stderr[-3000:]
    r = rows(tmp_path / "nan")
    assert r[2]["skipped"] and r[2]["grad_norm"] is None and r[2]["nonfinite"] == ["grad_norm"]
    assert not any(x.get("skipped") for x in r[:2])
    from safetensors.torch import load_file
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf2", "hf3"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_repeated_nan_stops_and_keeps_the_last_good_checkpoint(tmp_path, reference):
    out = tmp_path / "run"
    p = launch(2, out, "--max_steps", "8", "--ckpt_every", "2", "--max_skipped_steps", "2", fault="nan:5:8")
    assert p.returncode != 0
    lines = error_lines(p)
    assert len(lines) == 1 and "2 steps in a row had a non-finite" in lines[0], lines
    assert steps(out) == [2, 4]
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4, 5, 6]
    assert [(r["loss"], r["grad_norm"]) for r in rows(out)[:4]] == [(r["loss"], r["grad_norm"])
                                                                    for r in reference[:4]]


def test_corrupt_or_partial_checkpoints_are_skipped(tmp_path, reference):
    out = tmp_path / "run"
    args = ["--max_steps", "8", "--ckpt_every", "2", "--keep_checkpoints", "3"]
    assert launch(2, out, *args, fault="kill:1:5").returncode != 0 and steps(out) == [2, 4]
    shard = next((out / "checkpoints" / "step_0000004").glob("*.distcp"))
    with open(shard, "r+b") as fh:  # truncated
        fh.truncate(os.path.getsize(shard) // 2)
    os.makedirs(out / "checkpoints" / "step_0000005")  # a folder with a checkpoint's name but no manifest
    p = launch(2, out, *args)
    assert p.returncode == 0, p.stderr[-3000:]
    warnings = [line for line in p.stdout.splitlines() if line.startswith("warning: skipping checkpoint")]
    assert len(warnings) == 2 and "manifest" in warnings[0] and "bytes, the manifest says" in warnings[1], warnings
    assert "resumed from" in p.stdout and "step_0000002 after step 2" in p.stdout
    assert_same_run(rows(out), reference)


def test_resume_refuses_another_model_and_none_refuses_to_overwrite(tmp_path):
    out = tmp_path / "run"
    assert launch(1, out, "--max_steps", "2").returncode == 0
    cfg = dict(model_type="qwen3", vocab_size=257, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps(cfg))
    p = launch(2, out, "--max_steps", "4", "--model", str(tmp_path / "other"))
    lines = error_lines(p)
    assert p.returncode != 0 and len(lines) == 1 and "belongs to another run" in lines[0], lines
    assert "model.hidden_size 64 -> 32" in lines[0], lines
    before = open(out / "metrics.jsonl").read()
    p = launch(2, out, "--max_steps", "4", "--resume", "none")
    lines = error_lines(p)
    assert p.returncode != 0 and "holds an earlier run" in lines[0] and "--overwrite true" in lines[0], lines
    assert open(out / "metrics.jsonl").read() == before  # a failed start changes nothing
    p = launch(2, out, "--max_steps", "4", "--resume", "none", "--overwrite", "true")
    assert p.returncode == 0 and [r["step"] for r in rows(out)] == [1, 2, 3, 4]


def test_broken_tokenizer_and_save_dir_under_a_file_stop_before_step_one(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{ not json")
    p = launch(2, tmp_path / "a", "--tokenizer", str(tmp_path / "tokenizer.json"))
    lines = error_lines(p)
    assert p.returncode != 0 and any("data:" in line for line in lines), p.stderr[-3000:]
    assert all(len(line) < 400 for line in lines)
    (tmp_path / "file").write_text("")
    p = launch(2, tmp_path / "b", "--save_dir", str(tmp_path / "file" / "hf"))
    lines = error_lines(p)
    assert p.returncode != 0 and "is a file, not a folder" in lines[0], lines
    assert not (tmp_path / "b" / "metrics.jsonl").exists()


def test_data_that_runs_out_ends_the_run_with_a_checkpoint(tmp_path):
    text = "".join(f"book {i}: " + "lorem ipsum dolor sit amet " * 30 + "\n" for i in range(3))
    (tmp_path / "books.txt").write_text(text)  # ~2.5k bytes: 9 windows of 265 tokens
    out = tmp_path / "run"
    p = launch(1, out, "--data", str(tmp_path / "books.txt"), "--max_steps", "50", "--ckpt_every_min", "0")
    assert p.returncode == 0, p.stderr[-3000:]
    last = rows(out)[-1]["step"]
    assert 3 < last < 50 and "the data ran out after step" in p.stdout and steps(out) == [last]


def mount_small_disk(d, size: str):
    """A tmpfs of `size` at folder d (skips the test where mounting needs a privilege this process lacks)."""
    d.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here to fill ({p.stderr.strip()[:100]}); needs root or CAP_SYS_ADMIN")
    return d


@pytest.fixture
def small_disk(tmp_path):
    yield mount_small_disk(tmp_path / "disk", "6m")
    subprocess.run(["umount", "-l", str(tmp_path / "disk")])


def test_a_full_disk_stops_with_one_line_and_keeps_the_last_checkpoint(small_disk):
    """The tiny model's checkpoint is ~1.7 MiB (119k parameters: fp32 weights + two AdamW states, and dcp's
    framing) on a 6 MiB disk: room for the 3 that --keep_checkpoints 2 needs at once, until another program
    fills the disk to 1 MiB free after the first checkpoint: the second does not fit."""
    out = small_disk / "run"
    p = launch(2, out, "--max_steps", "4", "--ckpt_every", "2", "--keep_checkpoints", "2",
               fault=f"fill:3:{2**20}")
    lines = error_lines(p)
    # the cause as the writer saw it ("No space left on device", or torch's "unexpected pos" on a short write),
    # then the free space against what a checkpoint takes
    assert p.returncode != 0 and len(lines) == 2 and "MiB free, less than the last checkpoint's" in lines[0], lines
    assert "step_0000004" in lines[0] and "earlier checkpoints are intact" in lines[0]
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_0000002"]  # no .tmp left behind


def test_a_disk_too_small_for_one_checkpoint_stops_before_step_one(small_disk):
    big = small_disk / "filler"
    big.write_bytes(b"\0" * (6 * 2**20 - 100 * 1024))
    p = launch(2, small_disk / "run", "--max_steps", "4")
    lines = error_lines(p)
    assert p.returncode != 0 and "MiB free on its disk, but a checkpoint needs about" in lines[0], lines
    assert not (small_disk / "run" / "metrics.jsonl").exists()
    # a run that writes no checkpoint needs no room for one (its logs are small)
    p = launch(2, small_disk / "run", "--max_steps", "2", "--checkpoints", "false")
    assert p.returncode == 0, error_lines(p)
    assert len((small_disk / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_cpu_run_past_its_ram_stops_in_one_line_before_the_model_is_built(tmp_path):
    """Qwen3-8B's full fine-tune on a CPU node given 24 GiB (it needs over 100): every rank stops before any
    weight is allocated, with rank 0's one line naming the need and what to change, instead of the OS killing a
    rank without a word; nothing is left behind. With LoRA the line does not suggest LoRA; with --fit off (the
    levers as given) the RAM is checked all the same."""
    model = os.path.join(ROOT, "bench", "configs", "qwen3-8b")
    p = launch(2, tmp_path / "run", "--model", model, "--host_mem_gib", "24", timeout=120)
    lines = error_lines(p)
    assert p.returncode != 0 and len(lines) == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert lines[0].startswith("error: on the CPU this run needs about ") and "but it has 24 GiB; use LoRA" in lines[0]
    assert not (tmp_path / "run").exists()
    p = launch(2, tmp_path / "run", "--model", model, "--host_mem_gib", "24", "--lora_rank", "8", timeout=120)
    lines = error_lines(p)
    assert len(lines) == 1 and "it has 24 GiB; a shorter --seq_len" in lines[0], lines
    p = launch(2, tmp_path / "run", "--model", model, "--host_mem_gib", "24", "--fit", "off", timeout=120)
    lines = error_lines(p)
    assert len(lines) == 1 and lines[0].startswith("error: on the CPU this run needs about "), lines
    assert not (tmp_path / "run").exists()


def test_the_export_is_whole_and_carries_the_run_tokenizer(tmp_path):
    """--save_dir is written beside and renamed into place (an earlier export is replaced whole, never mixed);
    it holds the tokenizer given by --tokenizer, with ordinary file permissions."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["<|endoftext|>", "[UNK]"] + [f"w{i}" for i in range(40)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model-00001-of-00002.safetensors").write_text("a shard of an earlier, sharded export")
    p = launch(2, tmp_path / "run", "--max_steps", "1", "--tokenizer", str(tmp_path / "tokenizer.json"),
               "--save_dir", str(hf))
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(os.listdir(hf)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (hf / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    assert all(os.stat(hf / f).st_mode & 0o044 == 0o044 for f in os.listdir(hf))  # readable by group and others
    assert not [d for d in os.listdir(tmp_path) if d.startswith("hf.")]  # no temporary folder left
