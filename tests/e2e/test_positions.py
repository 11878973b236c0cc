"""Loss by position (metrics.jsonl, every step) and held-out evaluation (eval.jsonl), end to end under torchrun on
CPU: the spans add back to the step's loss, context and data parallelism do not change them, and the evaluation
matches full logits computed here on the same held-out windows. About 40 s on 2 CPU cores.

    python -m pytest tests/e2e/test_positions.py -q
"""
import json

import pytest
import torch
import torch.nn.functional as F

import data
from .test_train import run

T, K = 264, 16  # 16 spans of 264 positions: 16 or 17 positions each (p * 16 // 264), on purpose unequal
EVAL = ["--loss_buckets", str(K), "--eval_every", "2", "--eval_sequences", "2"]


def span_sizes(seq_len, k):
    return torch.bincount(torch.arange(seq_len) * k // seq_len, minlength=k).double()             # [k]


def eval_rows(tmp, nproc, args):
    """eval.jsonl of the run that test_train.run(tmp, nproc, *args) made (it names the folder so)."""
    return [json.loads(line) for line in open(tmp / f"run{nproc}_{abs(hash(tuple(args)))}" / "eval.jsonl")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same two windows per step three ways: 1 rank accumulating 2, cp 2 x dp 2, cp 4 accumulating 2."""
    tmp = tmp_path_factory.mktemp("positions")
    out = {}
    for name, nproc, args in [("cp1", 1, ["--cp", "1", "--grad_accum", "2"]), ("cp2dp2", 4, ["--cp", "2"]),
                              ("cp4", 4, ["--cp", "4", "--grad_accum", "2", "--save_dir", str(tmp / "saved")])]:
        out[name] = (run(tmp, nproc, *args, *EVAL), eval_rows(tmp, nproc, [*args, *EVAL]))
    out["tmp"] = tmp
    return out


def test_spans_add_up_to_the_step_loss(runs):
    rows, evals = runs["cp1"]
    w = span_sizes(T, K)
    for r in rows + evals:
        assert len(r["loss_by_position"]) == K
        by_pos = torch.tensor(r["loss_by_position"], dtype=torch.float64)
        assert (by_pos * w).sum().item() / T == pytest.approx(r["loss"], rel=1e-5), r
    assert [e["step"] for e in evals] == [0, 2, 3]  # before the first step, every 2, after the last
    assert all(e["sequences"] == 2 and e["num_tokens"] == 2 * T and e["seq_len"] == T for e in evals)


def test_parallelism_does_not_change_the_spans(runs):
    ref_rows, ref_evals = runs["cp1"]
    for name in ("cp2dp2", "cp4"):
        rows, evals = runs[name]
        for a, b in zip(ref_rows + ref_evals, rows + evals, strict=True):
            assert a["step"] == b["step"]
            torch.testing.assert_close(torch.tensor(b["loss_by_position"]), torch.tensor(a["loss_by_position"]),
                                       rtol=1e-5, atol=0, msg=f"{name}, step {a['step']}")


def test_evaluation_matches_full_logits_on_held_out_windows(runs):
    """The step-0 evaluation (the random init train.py draws with --seed 0) against model.logits on the first two
    windows of the synthetic validation split, read here with data.py directly: the same loss at every position,
    the spans formed here from global positions."""
    from model import Qwen3, Qwen3Config
    m = Qwen3(Qwen3Config.tiny()).float()
    m.init_weights(torch.Generator("cpu").manual_seed(0))
    byte = data.ByteTokenizer()
    loader = data.WindowLoader(
        lambda b: data.tokenized(data.iter_books("synthetic", seed=0, start_book=b, split="validation"), byte), T)
    windows = torch.stack([next(loader) for _ in range(2)])                                      # [2, T + 1]
    loader.close()
    train = data.WindowLoader(lambda b: data.tokenized(data.iter_books("synthetic", seed=0, start_book=b), byte), T)
    assert not torch.equal(next(train), windows[0])  # held out: not the training stream's first window
    train.close()
    with torch.no_grad():
        nll = F.cross_entropy(m.logits(windows[:, :-1]).transpose(1, 2).double(), windows[:, 1:],
                              reduction="none")                                                   # [2, T]
    spans = torch.arange(T) * K // T
    want = torch.stack([nll[:, spans == b].mean() for b in range(K)])
    for name in ("cp1", "cp2dp2", "cp4"):
        step0 = runs[name][1][0]
        assert step0["step"] == 0
        assert step0["loss"] == pytest.approx(nll.mean().item(), rel=1e-5)
        torch.testing.assert_close(torch.tensor(step0["loss_by_position"], dtype=torch.float64), want, rtol=1e-5,
                                   atol=0)


def test_eval_only_measures_a_saved_model_and_writes_nothing_else(runs):
    """--eval_only true on the HF export of the cp 4 run gives its last evaluation (same weights, same windows),
    on another world size, and leaves no checkpoint and no metrics.jsonl; a second call adds a row."""
    tmp = runs["tmp"]
    out = tmp / "eval_only"
    out.mkdir()
    (out / "eval.jsonl").write_text(json.dumps({"step": 0, "loss": 9.0, "model": "an earlier call"}) + "\n")
    p, _ = run(tmp, 2, "--model", str(tmp / "saved"), "--eval_only", "true", *EVAL, "--out_dir", str(out),
               check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(x.name for x in out.iterdir()) == ["eval.jsonl"]
    earlier, row = [json.loads(line) for line in open(out / "eval.jsonl")]
    last = runs["cp4"][1][-1]
    assert earlier["loss"] == 9.0 and row["step"] == 0 and row["loss"] == pytest.approx(last["loss"], rel=1e-5)
    torch.testing.assert_close(torch.tensor(row["loss_by_position"]), torch.tensor(last["loss_by_position"]),
                               rtol=1e-5, atol=0)


def test_one_training_file_needs_eval_data(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("a book " * 200)
    p, _ = run(tmp_path, 1, "--data", str(book), "--eval_every", "1", check=False, timeout=60)
    assert p.returncode != 0 and "--eval_data" in p.stderr, p.stderr[-2000:]
