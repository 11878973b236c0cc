"""YaRN at small scale, on a CPU in a few minutes: the loss along a sequence 8x longer than the model was trained
on, with the checkpoint's RoPE, with YaRN at the matching factor, and after a short fine-tune at the long length
with YaRN. The small version of the guide's figure (last 20k tokens of 160k: loss 7.3 without scaling, 2.8 with).

    python bench/yarn_small.py                 # ~3 minutes on 2 CPU cores -> bench/results/yarn_small.{json,png}
    python bench/yarn_small.py --train_steps 50 --finetune_steps 5 --out /tmp/yarn_check   # the script only

Every stage is a train.py command (printed as it runs), so each can be re-run by hand:
1. train the tiny Qwen3 (2 layers, hidden 64, RoPE theta 10,000) from scratch at --seq_len L on synthetic books
   (data "synthetic:100": ~1,300 characters, a passage repeated ~600 then ~330 characters later), export it;
2. evaluate it at 8L on held-out books (the synthetic validation split) with its own RoPE (--yarn_factor 0),
3. ... and with YaRN (--yarn_factor 8 --yarn_original_max_position_embeddings L), no training;
4. fine-tune it at 8L with YaRN for a few steps and evaluate again;
5. the control: the same fine-tune with the checkpoint's RoPE (does YaRN still matter after fine-tuning?).
The same held-out windows are read at every evaluation. Writes the curves (16 spans of the sequence each) and
each curve's mean loss over the last eighth of the sequence.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from plot_positions import plot, span_middles, tail_mean  # noqa: E402
from timing import demo_run  # noqa: E402


def train_py(args, work, name, *flags):
    """One train.py run (world of one) in work/name; -> its eval.jsonl rows."""
    out = os.path.join(work, name)
    demo_run(out, name, ["--data", args.data, "--seed", args.seed, "--loss_buckets", args.buckets,
                         "--eval_sequences", args.eval_sequences, "--checkpoints", "false", *flags],
             args.threads, "eval ")
    with open(os.path.join(out, "eval.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq_len", type=int, default=512, help="the training length L")
    ap.add_argument("--factor", type=int, default=8, help="evaluate at factor x L, with YaRN at this factor")
    ap.add_argument("--data", default="synthetic:100")
    ap.add_argument("--train_steps", type=int, default=2000)
    ap.add_argument("--finetune_steps", type=int, default=150)
    ap.add_argument("--finetune_lr", type=float, default=1e-3)
    ap.add_argument("--eval_sequences", type=int, default=8)
    ap.add_argument("--buckets", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"), help="folder for yarn_small.json/.png")
    ap.add_argument("--work", default="/tmp/yarn_small", help="the runs' folders (replaced)")
    args = ap.parse_args()
    L, long = args.seq_len, args.seq_len * args.factor
    yarn = ["--yarn_factor", args.factor, "--yarn_original_max_position_embeddings", L]
    os.makedirs(args.out, exist_ok=True)
    t0, short = time.time(), os.path.join(args.work, "short", "hf")
    common = ["--resume", "none", "--overwrite", "true"]

    trained = train_py(args, args.work, "short", "--seq_len", L, "--max_steps", args.train_steps, "--warmup_steps",
                       50, "--loss_chunk", L, "--eval_every", args.train_steps, "--save_dir", short, *common)
    rope = train_py(args, args.work, "rope", "--model", short, "--seq_len", long, "--loss_chunk", 1024,
                    "--eval_only", "true", "--yarn_factor", 0)
    yarn_rows = train_py(args, args.work, "yarn", "--model", short, "--seq_len", long, "--loss_chunk", 1024,
                         "--eval_only", "true", *yarn)
    finetune = ["--model", short, "--seq_len", long, "--loss_chunk", 1024, "--max_steps", args.finetune_steps,
                "--lr", args.finetune_lr, "--warmup_steps", 10, "--eval_every", args.finetune_steps, *common]
    tuned = train_py(args, args.work, "yarn_finetune", *finetune, *yarn)
    control = train_py(args, args.work, "rope_finetune", *finetune, "--yarn_factor", 0)  # does YaRN still matter?

    curves = [
        dict(label=f"trained length {L}, its RoPE", seq_len=L, y=trained[-1]["loss_by_position"], row=trained[-1]),
        dict(label=f"{args.factor}x length, the checkpoint's RoPE", seq_len=long, y=rope[-1]["loss_by_position"],
             row=rope[-1]),
        dict(label=f"{args.factor}x length, YaRN x{args.factor}, no training", seq_len=long,
             y=yarn_rows[-1]["loss_by_position"], row=yarn_rows[-1]),
        dict(label=f"{args.factor}x length, YaRN x{args.factor}, {args.finetune_steps} fine-tuning steps",
             seq_len=long, y=tuned[-1]["loss_by_position"], row=tuned[-1]),
        dict(label=f"{args.factor}x length, the checkpoint's RoPE, {args.finetune_steps} fine-tuning steps",
             seq_len=long, y=control[-1]["loss_by_position"], row=control[-1]),
    ]
    for c in curves:
        c["positions"] = span_middles(c["seq_len"], len(c["y"]))
        c["mean"] = c["row"]["loss"]
        c["last_eighth"] = tail_mean(c["positions"], c["y"], c["seq_len"])
    result = dict(
        what=f"tiny Qwen3 trained {args.train_steps} steps at {L} tokens, evaluated at {long} on "
             f"{args.eval_sequences} held-out sequences of {args.data} (validation split)",
        command="python bench/yarn_small.py " + " ".join(sys.argv[1:]), minutes=(time.time() - t0) / 60,
        curves=[{k: c[k] for k in ("label", "seq_len", "positions", "y", "mean", "last_eighth")} for c in curves])
    with open(os.path.join(args.out, "yarn_small.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    try:
        plot(curves, os.path.join(args.out, "yarn_small.png"), trained_len=L,
             title=f"tiny Qwen3 trained at {L} tokens, evaluated at {long} (held-out synthetic books)")
        picture = "and yarn_small.png"
    except ImportError:  # matplotlib is for the picture only, not a dependency
        picture = "(no matplotlib: no picture)"
    print(f"\n{'curve':70s} {'mean':>6s} {'last 1/8':>8s}")
    for c in curves:
        print(f"{c['label']:70s} {c['mean']:6.3f} {c['last_eighth']:8.3f}")
    print(f"wrote {args.out}/yarn_small.json {picture} in {result['minutes']:.1f} min")


if __name__ == "__main__":
    main()
