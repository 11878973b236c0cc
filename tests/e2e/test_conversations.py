"""train.py on conversations end to end (CPU, gloo): packed "docs" windows of messages and prompt/completion rows,
the loss on the assistant's tokens only, averaged over the trained tokens of the whole step.

The oracle for the first step's loss: each document of the step's windows run alone, from position 0, through
transformers' Qwen3ForCausalLM on the same initial weights, its NLL summed over the trained labels and divided by
their count over every window of the step. Then every layout (cp 1/2/4, dp 2, --grad_accum 2, both
--doc_attention paths) gives the same losses and gradient norms as one process, although some ranks' shards hold no
trained token at all (a long user turn), and the windows hold very different numbers of trained tokens.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers  # a test dependency: the independent reference

from million import chat
import data
from million import hf
from million import packing
from million.hf import load_or_init_state_dict, save_pretrained
from model import Qwen3, Qwen3Config
from test_rows import CHATS, QWEN3, write_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ = 264  # 33 tokens per zigzag chunk at cp 4
FLAGS = ["--device", "cpu", "--dtype", "float32", "--yarn_factor", "0", "--seq_len", str(SEQ), "--max_steps", "2",
         "--loss_chunk", "100", "--lr", "1e-3", "--warmup_steps", "0", "--checkpoints", "false", "--seed", "0",
         "--offload", "false", "--tiled_mlp", "false"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A Qwen3-style model folder (tokenizer, chat template, a tiny config, no weights: random init) and a JSONL
    file of conversations, prompt/completion rows and text."""
    root = tmp_path_factory.mktemp("conv")
    folder = write_model(root / "model", {"chat_template": QWEN3})
    tok = data.load_tokenizer(str(folder))
    mcfg = Qwen3Config.tiny(vocab_size=512)
    assert tok.vocab_size <= mcfg.vocab_size
    (folder / "config.json").write_text(json.dumps(hf.config_to_dict(mcfg)))
    lecture = [{"role": "user", "content": "Tell me about the weather in Paris and in Rome. " * 8},  # > 66 tokens
               {"role": "assistant", "content": "Sunny."}]
    rows = [{"messages": CHATS["plain"][0]}, {"messages": lecture},
            {"prompt": "The weather is", "completion": " sunny."},
            {"messages": CHATS["reasoning"][0]}, {"text": "Hello there, how are you?"},
            {"messages": CHATS["tools"][0], "tools": CHATS["tools"][1]}, {"messages": CHATS["no_system"][0]}]
    path = root / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * 6))
    return folder, path, tok, mcfg


def train(tmp_path, setup, nproc, *args, data_path=None):
    folder, path, _, _ = setup
    path = data_path or path
    out = tmp_path / f"run{nproc}_{abs(hash(args))}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "train.py"), "--model", str(folder), "--data", str(path), *FLAGS, "--out_dir", str(out),
           *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return [json.loads(line) for line in open(out / "metrics.jsonl")], p.stdout


def first_step_loss_in_transformers(setup, tmp_path):
    """The mean NLL over the trained labels of windows 0 and 1 (step 1 of one process with --grad_accum 2), each
    document alone from position 0, through transformers on the initial weights."""
    folder, path, tok, mcfg = setup
    names = list(Qwen3(mcfg).state_dict())
    sd = load_or_init_state_dict(str(folder), mcfg, names, torch.float32, 0, torch.device("cpu"))
    m = Qwen3(mcfg)
    m.load_state_dict(sd)
    save_pretrained(m, str(tmp_path / "init"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "init"), dtype=torch.float32)
    loader = packing.PackedLoader(lambda row: chat.iter_documents(str(path), tok, start_row=row), SEQ, tok.eos_id)
    windows = [next(loader) for _ in range(2)]
    total, count, per_window = 0.0, 0, []
    with torch.no_grad():
        for w in windows:
            start, trained = 0, int((w.labels != -100).sum())
            for length in w.doc_lens:
                doc = slice(start, start + length)
                logits = hf(w.inputs[doc][None]).logits[0]
                total += F.cross_entropy(logits, w.labels[doc], ignore_index=-100, reduction="sum").item()
                start += length
            count += trained
            per_window.append(trained)
    return total / count, per_window, windows


def test_the_loss_is_the_mean_over_trained_tokens_in_every_layout(setup, tmp_path):
    want, per_window, windows = first_step_loss_in_transformers(setup, tmp_path)
    assert per_window[0] != per_window[1] and all(0 < n < SEQ // 2 for n in per_window)  # uneven, mostly untrained
    chunk = SEQ // 8  # some cp 4 chunk holds no trained label: its rank contributes zero but joins every collective
    assert any((w.labels[i:i + chunk] == -100).all() for w in windows for i in range(0, SEQ, chunk))

    one, said = train(tmp_path, setup, 1, "--cp", "1", "--grad_accum", "2")
    assert one[0]["loss"] == pytest.approx(want, rel=1e-5), (one[0]["loss"], want)
    assert one[0]["num_tokens"] == sum(per_window) and 0.5 < one[0]["untrained_share"] < 1  # trained tokens
    for nproc, args in ((2, ("--cp", "1")),                          # dp 2: a window each
                        (2, ("--cp", "2", "--grad_accum", "2")),     # the ring over 2 ranks
                        (2, ("--cp", "2", "--grad_accum", "2", "--doc_attention", "simple")),  # zigzag, per piece
                        (4, ("--cp", "4", "--grad_accum", "2"))):    # over 4: chunks of 33 tokens
        got, _ = train(tmp_path, setup, nproc, *args)
        assert len(got) == len(one) == 2
        for a, b in zip(one, got):
            assert b["num_tokens"] == a["num_tokens"]
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (nproc, args, a, b)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (nproc, args, a, b)


def test_assistant_only_loss_false_trains_every_token(setup, tmp_path):
    """The flag reaches the data: with the mask off, only the pairs that cross a document's end or padding go
    untrained."""
    got, _ = train(tmp_path, setup, 1, "--assistant_only_loss", "false", "--completion_only_loss", "false",
                   "--max_steps", "1")
    assert got[0]["untrained_share"] == 0.0


def test_padding_is_not_counted_as_a_document(setup, tmp_path):
    """One short row: the window is that document and padding; metrics.jsonl's docs counts the document alone."""
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"prompt": "The weather is", "completion": " sunny."}) + "\n")
    got, _ = train(tmp_path, setup, 1, "--max_steps", "1", "--packing", "docs", data_path=path)
    assert got[0]["pad_share"] > 0.5 and got[0]["docs"] == 1, got[0]


def test_skipped_rows_are_counted_in_the_metrics(setup, tmp_path):
    """A bad row is counted in metrics.jsonl's skipped_rows, in a stream of text (concat) as among documents."""
    path = tmp_path / "books.jsonl"
    path.write_text(json.dumps({"text": "Hello."}) + "\n" + '{"text": "unterminated\n'
                    + json.dumps({"text": "It was the best of times, it was the worst of times. " * 30}) + "\n")
    for kind in ("concat", "docs"):
        got, _ = train(tmp_path, setup, 1, "--packing", kind, "--max_steps", "1", data_path=path)
        assert got[0]["skipped_rows"] == 1, (kind, got[0])
