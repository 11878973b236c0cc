"""train.py end to end under torchrun on CPU (gloo): context parallelism and data parallelism must not change
the math, the final save loads, and bad input stops every rank with a message instead of a hang."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAST = ["--config", "demo", "--device", "cpu", "--dtype", "float32", "--seed", "0", "--seq_len", "264",
        "--max_steps", "3", "--loss_chunk", "100"]


def run(tmp_path, nproc, *args, timeout=240, check=True):
    out = tmp_path / f"run{nproc}_{abs(hash(args))}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "train.py"), *FAST, "--out_dir", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(tmp_path))
    if check:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
        return [json.loads(line) for line in open(out / "metrics.jsonl")]
    return p, time.time() - t0  # a hang would have raised TimeoutExpired


def same_steps(a, b, rtol=1e-5):
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert x["num_tokens"] == y["num_tokens"]
        assert x["loss"] == pytest.approx(y["loss"], rel=rtol), (x, y)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=rtol * 10), (x, y)


def test_context_parallel_degree_does_not_change_the_math(tmp_path):
    """cp 1, 2 and 4 on one 264-token sequence (chunks of 33 tokens at cp 4): same losses and grad norms."""
    cp1 = run(tmp_path, 1, "--cp", "1")
    cp2 = run(tmp_path, 2, "--cp", "2")
    cp4 = run(tmp_path, 4, "--cp", "4")
    same_steps(cp1, cp2)
    same_steps(cp1, cp4)
    assert cp1[-1]["loss"] < cp1[0]["loss"]  # and it learns
    for k in ("step", "loss", "grad_norm", "num_tokens", "lr", "step_time_s", "tokens_per_s", "peak_mem_gib"):
        assert k in cp1[0]


def test_data_parallel_equals_gradient_accumulation(tmp_path):
    """2 data-parallel ranks (FSDP2 over both) see windows 0 and 1 of the stream, as one rank accumulating 2."""
    one = run(tmp_path, 1, "--cp", "1", "--grad_accum", "2")
    dp2 = run(tmp_path, 2, "--cp", "1")
    dp2cp2 = run(tmp_path, 4, "--cp", "2")
    same_steps(one, dp2)
    same_steps(one, dp2cp2)
    assert one[0]["num_tokens"] == 2 * 264


def test_levers_on_do_not_change_the_run(tmp_path):
    plain = run(tmp_path, 2, "--recompute", "false", "--offload", "false", "--tiled_mlp", "false",
                "--keep_attention", "false")
    levers = run(tmp_path, 2, "--recompute", "true", "--offload", "true", "--tiled_mlp", "true", "--mlp_tile", "50",
                 "--keep_attention", "true", "--offload_layers", "1")
    same_steps(plain, levers)


def test_final_save_is_an_hf_checkpoint(tmp_path):
    from million import hf
    run(tmp_path, 2, "--save_dir", str(tmp_path / "saved"))
    m = hf.from_pretrained(str(tmp_path / "saved"), dtype=torch.float32)
    assert m.cfg.vocab_size == 257 and sorted(os.listdir(tmp_path / "saved")) == ["config.json", "model.safetensors"]
    # continue from it: a folder with weights loads (rank 0 reads, broadcasts) and trains
    again = run(tmp_path, 2, "--model", str(tmp_path / "saved"), "--max_steps", "3")
    first = run(tmp_path, 2)
    assert again[0]["loss"] < first[0]["loss"]  # it starts from the trained weights, not from scratch


def test_resume_continues_exactly(tmp_path):
    """4 steps straight == 2 steps, checkpoint, then resume for steps 3-4 on another world size (constant lr, so
    the schedule does not depend on --max_steps)."""
    const = ["--warmup_steps", "0", "--min_lr_ratio", "1"]
    straight = run(tmp_path, 2, "--max_steps", "4", *const)
    first = tmp_path / "first"
    p, _ = run(tmp_path, 2, "--max_steps", "2", "--ckpt_every", "2", "--out_dir", str(first), *const, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.load(open(first / "checkpoints" / "step_0000002" / "trainer.json"))["step"] == 2
    p, _ = run(tmp_path, 4, "--max_steps", "4", "--cp", "4", "--resume", str(first / "checkpoints" / "step_0000002"),
               "--out_dir", str(first), *const, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    resumed = [json.loads(line) for line in open(first / "metrics.jsonl")]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight[2:], resumed[2:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                               rel=1e-4)


@pytest.mark.parametrize("nproc,args,msg", [
    (2, ["--seq_len", "262"], "multiple of 2\\*cp = 4"),
    (2, ["--cp", "4"], "does not divide the world size 2"),
    (1, ["--offload", "maybe"], "takes true or false"),
    (1, ["--lr", "fast"], "takes a float"),
    (1, ["--no_such_flag", "1"], "unknown flag"),
    (1, ["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "tpu"], "--device"),
    (2, ["--attn_backend", "fa4"] if not torch.cuda.is_available() else ["--attn_backend", "fa5"], "--attn_backend"),
    (2, ["--model", "/nonexistent/qwen"], "no such folder"),
    (2, ["--data", "/nonexistent/books.txt"], "books.txt"),
    (2, ["--data", "/nonexistent/books.txt", "--packing", "concat"], "books.txt"),  # read by the cp group's first rank
    (2, ["--resume", "/nonexistent/ckpt"], "not a checkpoint folder"),
    (1, ["--param_dtype", "float16"], "--param_dtype float16: use bfloat16 or float32"),
    (1, ["--profile_step", "4"], "--profile_step 4: 0 \\(off\\) or a step in 1..--max_steps"),
    (1, ["--data_split", "nosuch"], "split 'nosuch'"),  # --data_split reaches the reader
    (1, ["--eval_only", "true", "--eval_split", "nosuch"], "split 'nosuch'"),  # and --eval_split the evaluation
])
def test_bad_input_stops_every_rank_with_a_message(tmp_path, nproc, args, msg):
    p, _ = run(tmp_path, nproc, *args, check=False, timeout=120)
    assert p.returncode != 0
    assert re.search(msg, p.stdout + p.stderr), p.stderr[-3000:]
    assert 'train.py", line' not in p.stderr, p.stderr[-3000:]  # torchrun's own report aside, no traceback
    lines = [x for x in p.stderr.splitlines() if x.startswith("error")]
    assert len(lines) == 1, lines  # said once, though every rank stops


def test_model_that_is_not_full_attention_is_refused(tmp_path):
    cfg = dict(model_type="qwen3", vocab_size=257, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_sliding_window=True,
               sliding_window=128)
    (tmp_path / "swa").mkdir()
    (tmp_path / "swa" / "config.json").write_text(json.dumps(cfg))
    p, _ = run(tmp_path, 2, "--model", str(tmp_path / "swa"), check=False, timeout=120)
    assert p.returncode != 0 and "sliding" in p.stderr, p.stderr[-3000:]
    lines = [x for x in p.stderr.splitlines() if x.startswith("error")]
    assert len(lines) == 1, lines  # said once (by rank 0), though every rank stops


def test_float32_master_weights_take_updates_that_bf16_weights_lose(tmp_path):
    """bf16 compute on both runs; --param_dtype float32 (the default) keeps the sharded weights and AdamW
    states in fp32. At lr 1e-5 one AdamW step moves every weight with a gradient by ~1e-5: the fp32 weights
    all take it, while bf16 weights mostly round it away (their resolution is ~1/256 of the weight).

    Counted over every weight but the embedding (whose rows for bytes absent from the batch get no gradient;
    weight decay is 0): 102,848 weights. Measured with `pytest -s tests/e2e/test_train.py -k master_weights`
    (2 CPU ranks, the tiny model): bf16 98.0% unmoved (98% of each matrix, all of the norm weights, which
    sit at 1.0), fp32 0.04%."""
    from million.hf import hf_name
    from model import Qwen3, Qwen3Config
    from safetensors.torch import load_file
    unmoved = {}
    for pd in ("float32", "bfloat16"):
        run(tmp_path, 2, "--dtype", "bfloat16", "--param_dtype", pd, "--lr", "1e-5", "--warmup_steps", "0",
            "--max_steps", "1", "--save_dir", str(tmp_path / pd))
        init = Qwen3(Qwen3Config.tiny()).to(getattr(torch, pd))  # the random init train.py draws (--seed 0)
        init.init_weights(torch.Generator("cpu").manual_seed(0))
        after = load_file(str(tmp_path / pd / "model.safetensors"))
        same = total = 0
        for n, w in init.named_parameters():
            assert after[hf_name(n)].dtype == w.dtype == getattr(torch, pd), n
            if n != "embed_tokens.weight":
                same += int((after[hf_name(n)] == w).sum())
                total += w.numel()
        unmoved[pd] = same / total
    print(f"unmoved after one step at lr 1e-5: {unmoved}")
    assert unmoved["bfloat16"] > 0.9 and unmoved["float32"] < 0.005, unmoved


def test_profile_step_writes_a_trace(tmp_path):
    """--profile_step N traces step N (on CPU: operators only; bench/profile_step.py reads the GPU ones)."""
    run(tmp_path, 2, "--profile_step", "2")
    out = next(tmp_path.glob("run2_*"))
    for rank in (0, 1):
        events = json.load(open(out / "profile" / f"trace_rank{rank}.json"))["traceEvents"]
        assert any(e.get("name") == "chunked_nll" for e in events)  # the loss's range is named


def test_grad_clip_changes_the_updates(tmp_path):
    """The demo's gradient norms are above 1 at first: --grad_clip 1 (the default) and 0 (off) start alike and
    part after two updates. Adam's first update does not depend on the gradient's scale, and clipping every step
    to the same norm changes only the steps' relative scale, so the difference is small (~1e-5 of the loss at
    step 3), but a run repeats bit for bit (tests/e2e/test_long_runs.py): any difference is the flag's."""
    clipped = run(tmp_path, 1)
    free = run(tmp_path, 1, "--grad_clip", "0")
    assert clipped[0]["grad_norm"] > 1 and clipped[0]["loss"] == free[0]["loss"]
    assert clipped[2]["loss"] != free[2]["loss"], (clipped, free)


def test_data_column_names_the_text_field(tmp_path):
    rows = [{"body": f"book {i}: " + "it was the best of times, it was the worst of times. " * 8} for i in range(4)]
    (tmp_path / "books.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p, _ = run(tmp_path, 1, "--data", str(tmp_path / "books.jsonl"), "--max_steps", "1", check=False)
    assert p.returncode != 0 and "no field 'text'" in p.stderr, p.stderr[-3000:]
    p, _ = run(tmp_path, 1, "--data", str(tmp_path / "books.jsonl"), "--data_column", "body", "--max_steps", "1",
               check=False)
    assert p.returncode == 0, p.stderr[-3000:]


def test_data_repo_and_revision_reach_the_hub_listing(tmp_path, monkeypatch):
    """Offline, the listing fails (after data.py's retries); its message names the repo and revision asked for."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    p, _ = run(tmp_path, 1, "--data", "pg19", "--data_repo", "someone/nosuch", "--data_revision", "v9",
               check=False)
    assert p.returncode != 0 and "datasets/someone/nosuch@v9" in p.stderr, p.stderr[-3000:]


def test_dist_timeout_min_bounds_the_wait_for_a_peer(tmp_path):
    """Rank 0 of a world of 2 whose rank 1 never starts: it stops after --dist_timeout_min (3 s here), not 30 min."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *FAST, "--out_dir", str(tmp_path / "run"),
                        "--dist_timeout_min", "0.05"], capture_output=True, text=True, timeout=120, env=env)
    lines = [x for x in p.stderr.splitlines() if x.startswith("error")]
    assert p.returncode != 0 and time.time() - t0 < 60 and len(lines) == 1, p.stderr[-3000:]
    assert "--dist_timeout_min 0.05" in lines[0], lines
