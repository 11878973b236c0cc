"""Retrieval at small scale, on a CPU: a tiny Qwen3 trained on passkey windows of length L retrieves its passkeys
at L, and the needle-in-a-haystack grid (retrieval.py, run by train.py --eval_only --retrieval true) shows where
it stops beyond L: with the RoPE it was trained with, with YaRN, and with YaRN after a short fine-tune at 8L.

    python bench/retrieval_small.py            # -> bench/results/retrieval_small.{json,png}, the model in --work
    python bench/retrieval_small.py --train_steps 100 --out /tmp/retrieval_check   # the script only

1. Training, here in one process (a batch of windows per step: train.py takes one window per micro-batch, and
   at this size its per-window overhead is the whole cost): the tiny Qwen3 (2 layers, hidden 64, RoPE theta
   10,000) from scratch on windows of L bytes (the byte tokenizer) built by retrieval.build_window from the
   synthetic corpus ("synthetic:100", training split), one needle each at a random depth. The loss is the mean
   NLL of every token plus that of the answer's tokens, which are 6 of the L: alone they move the weights
   too little to teach the copy in a few hundred steps. Held-out windows are scored every --check_every steps.
2. A copy of it fine-tuned the same way on windows of 8L with YaRN x8 (--finetune_steps, from books the first
   training did not reach).
3. The grid on held-out books (the synthetic validation split) at L, 2L, 4L, 8L, one needle a window, as train.py
   runs it: the trained model with its own RoPE (--yarn_factor 0) and with YaRN (--yarn_factor 8
   --yarn_original_max_position_embeddings L) but no more training, and the fine-tuned one. Each is a train.py
   command, printed as it runs.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
import data  # noqa: E402
from million import hf  # noqa: E402
from million import retrieval  # noqa: E402
from loss import chunked_nll  # noqa: E402
from model import Qwen3, Qwen3Config  # noqa: E402
from timing import demo_run  # noqa: E402

SOURCE = "synthetic:100"


def train(m, tok, length: int, steps: int, batch: int, lr: float, args, start_book: int = 0):
    """m after `steps` AdamW steps, each on `batch` passkey windows of `length` tokens."""
    opt = torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sents = retrieval.filler(retrieval.book_stream(SOURCE, "train", args.seed, start_book), tok)
    rng = np.random.default_rng([args.seed, length])
    check = retrieval.build_windows(tok, retrieval.Grid([length], [0.0, 0.5, 1.0], 8, 1), SOURCE, "validation",
                                    args.seed)
    t0 = time.time()
    for step in range(1, steps + 1):
        ws = [retrieval.build_window(tok, sents, length, [float(rng.uniform())], rng) for _ in range(batch)]
        h = m(torch.stack([w.ids[:-1] for w in ws])).flatten(0, 1)                    # [B * L, H]
        every = chunked_nll(h, m.head_weight(), torch.cat([w.ids[1:] for w in ws]))
        answers = chunked_nll(h, m.head_weight(), torch.cat([w.labels() for w in ws]))
        (every.loss_sum / every.n_valid + answers.loss_sum / answers.n_valid).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, step / 20)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.check_every == 0 or step == steps:
            [x] = retrieval.by_length(retrieval.cells(check, retrieval.score(m, check)))
            print(f"  step {step:5d} | loss {(every.loss_sum / every.n_valid).item():.3f} | held-out at "
                  f"{length}: exact match {x['exact_match']:.0%}, answer nll {x['nll']:.2f} | "
                  f"{time.time() - t0:.0f} s", flush=True)
    return m


def train_py(args, name, *flags):
    """One train.py run (world of one) in work/name; -> its retrieval.jsonl row."""
    out = os.path.join(args.work, name)
    demo_run(out, name, ["--seed", args.seed, *flags], args.threads, "retrieval ")
    with open(os.path.join(out, "retrieval.jsonl")) as fh:
        return json.loads(fh.readlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq_len", type=int, default=128, help="the training length L")
    ap.add_argument("--factor", type=int, default=8, help="test up to factor x L, with YaRN at this factor")
    ap.add_argument("--train_steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16, help="windows per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--finetune_steps", type=int, default=200, help="at factor x L with YaRN")
    ap.add_argument("--finetune_batch", type=int, default=4)
    ap.add_argument("--finetune_lr", type=float, default=1e-3)
    ap.add_argument("--check_every", type=int, default=100)
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--keys", type=int, default=8, help="needles per (length, depth) cell")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"), help="folder for retrieval_small.*")
    ap.add_argument("--work", default="/tmp/retrieval_small", help="the model and the runs' folders (replaced)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    L, tok, t0 = args.seq_len, data.ByteTokenizer(), time.time()
    os.makedirs(args.out, exist_ok=True)
    saved, tuned = os.path.join(args.work, "hf"), os.path.join(args.work, "hf_yarn_finetuned")
    print(f"training a tiny Qwen3 on passkey windows of {L} bytes", flush=True)
    torch.manual_seed(args.seed)
    m = Qwen3(Qwen3Config.tiny())
    m.init_weights()
    hf.save_pretrained(train(m, tok, L, args.train_steps, args.batch, args.lr, args), saved)
    long = Qwen3(m.cfg.yarn_scaled(args.factor, L))
    long.load_state_dict(m.state_dict())
    print(f"fine-tuning it with YaRN x{args.factor} on passkey windows of {L * args.factor} bytes", flush=True)
    hf.save_pretrained(train(long, tok, L * args.factor, args.finetune_steps, args.finetune_batch,
                             args.finetune_lr, args, start_book=10**6), tuned)  # books the first training did not reach
    lengths = ",".join(str(L * f) for f in (1, 2, 4, 8, 16) if f <= args.factor)
    grid = ["--tokenizer", "byte", "--data", SOURCE, "--eval_only", "true", "--eval_sequences",
            1, "--seq_len", L, "--retrieval", "true", "--retrieval_lengths", lengths, "--retrieval_depths",
            args.depths, "--retrieval_keys", args.keys, "--retrieval_needles", 1, "--loss_chunk", 1024]
    rows = {"rope": train_py(args, "rope", *grid, "--model", saved, "--yarn_factor", 0),
            "yarn": train_py(args, "yarn", *grid, "--model", saved, "--yarn_factor", args.factor,
                             "--yarn_original_max_position_embeddings", L),
            # the fine-tuned export's config.json holds its YaRN: --yarn_factor 0 keeps it
            "yarn_finetuned": train_py(args, "yarn_finetuned", *grid, "--model", tuned, "--yarn_factor", 0)}
    result = dict(
        what=f"tiny Qwen3 trained {args.train_steps} steps x {args.batch} passkey windows of {L} bytes (one needle "
             f"each), fine-tuned with YaRN x{args.factor} {args.finetune_steps} steps x {args.finetune_batch} "
             f"windows of {L * args.factor}; tested on held-out {SOURCE} books, one needle a window",
        command="python bench/retrieval_small.py " + " ".join(sys.argv[1:]), minutes=(time.time() - t0) / 60,
        runs={name: {k: r[k] for k in ("rope_scaling", "windows", "time_s", "by_length", "cells")}
              for name, r in rows.items()})
    with open(os.path.join(args.out, "retrieval_small.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    png = retrieval.plot([(f"the RoPE it was trained with (L = {L})", rows["rope"]["cells"]),
                          (f"YaRN x{args.factor}, no training", rows["yarn"]["cells"]),
                          (f"YaRN x{args.factor}, {args.finetune_steps} steps x {args.finetune_batch} windows at "
                           f"{L * args.factor}", rows["yarn_finetuned"]["cells"])],
                         os.path.join(args.out, "retrieval_small.png"),
                         title=f"tiny Qwen3 trained on passkeys at {L} tokens: exact match of the key")
    print(f"\n{'length':>8s}" + "".join(f"{name:>22s}" for name in rows))
    for i, x in enumerate(rows["rope"]["by_length"]):
        cells = [r["by_length"][i] for r in rows.values()]
        print(f"{x['length']:8,d}" + "".join(f"{c['exact_match']:12.0%} (nll {c['nll']:5.2f})" for c in cells))
    print(f"wrote {args.out}/retrieval_small.json" + (" and .png" if png else " (no matplotlib: no picture)")
          + f" in {result['minutes']:.1f} min")


if __name__ == "__main__":
    main()
