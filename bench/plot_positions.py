"""Loss against position in the sequence, from train.py's logs: one curve per evaluation (out_dir/eval.jsonl)
or per training run (out_dir/metrics.jsonl, the mean of its last steps). Needs matplotlib (not a test dependency).

    python bench/plot_positions.py runs/demo/eval.jsonl --out loss_by_position.png
    python bench/plot_positions.py runs/a/metrics.jsonl runs/b/metrics.jsonl --last 20 --logx true
    python bench/plot_positions.py runs/a/eval.jsonl --steps 0,100 --out a.png

Each point is one of the --loss_buckets equal spans of the sequence, drawn at the span's middle position; the
legend gives each curve's mean loss over the last eighth of the sequence (the tail the long context serves).
"""
import argparse
import json
import math
import os


def read_rows(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def span_middles(seq_len: int, k: int) -> list[float]:
    """The middle position of each of k spans: position p lies in span p * k // seq_len (train.py)."""
    first = [-(-b * seq_len // k) for b in range(k)]  # the smallest p with p * k // seq_len == b: ceil(b*T/k)
    return [(a + b - 1) / 2 for a, b in zip(first, first[1:] + [seq_len])]


def tail_mean(xs: list[float], ys: list, seq_len: int, fraction: float = 1 / 8) -> float:
    """Mean loss over the spans whose middle lies in the last `fraction` of the sequence (spans are equal, so a
    plain mean); with 16 spans, the last 2."""
    tail = [y for x, y in zip(xs, ys) if x >= (1 - fraction) * seq_len and y is not None]
    return sum(tail) / len(tail) if tail else math.nan


def curves_from(path: str, steps: set | None, last: int, label: str | None) -> list[dict]:
    """-> [{label, seq_len, x, y}] from one eval.jsonl (a curve per chosen row) or metrics.jsonl (one curve: the
    mean over the last `last` steps; one step is one sequence, too noisy alone)."""
    rows = [r for r in read_rows(path) if r.get("loss_by_position")]
    if steps is not None:
        rows = [r for r in rows if r["step"] in steps]
    if not rows:
        raise SystemExit(f"{path}: no rows with loss_by_position" + (f" at steps {sorted(steps)}" if steps else ""))
    name = label or os.path.basename(os.path.dirname(os.path.abspath(path)))
    if "seq_len" in rows[0]:  # eval.jsonl rows say their length
        return [dict(label=f"{name}, step {r['step']}" if len(rows) > 1 else name, seq_len=r["seq_len"],
                     y=r["loss_by_position"]) for r in rows]
    cfg = os.path.join(os.path.dirname(path), "train_config.json")
    if not os.path.exists(cfg):
        raise SystemExit(f"{path}: no train_config.json beside it to give the sequence length")
    rows = rows[-last:] if steps is None else rows
    k = len(rows[0]["loss_by_position"])
    y = [sum(r["loss_by_position"][b] for r in rows) / len(rows) for b in range(k)]
    steps_txt = f"step {rows[0]['step']}" if len(rows) == 1 else f"steps {rows[0]['step']}-{rows[-1]['step']}"
    return [dict(label=f"{name}, train, {steps_txt}", seq_len=json.load(open(cfg))["seq_len"], y=y)]


def plot(curves: list[dict], out: str, title: str = "", logx: bool = False, trained_len: int = 0):
    """curves: [{label, seq_len, y}] -> a PNG at `out`. trained_len > 0 draws a line where training stopped."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for c in curves:
        x = span_middles(c["seq_len"], len(c["y"]))
        pts = [(a, b) for a, b in zip(x, c["y"]) if b is not None]
        ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", ms=3,
                label=f"{c['label']} (last eighth {tail_mean(x, c['y'], c['seq_len']):.2f})")
    if trained_len:
        ax.axvline(trained_len, color="grey", ls=":", lw=1)
        ax.text(trained_len, ax.get_ylim()[0], " trained length", va="bottom", fontsize=8, color="grey")
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel("position in the sequence (tokens)")
    ax.set_ylabel("mean loss (nats per token)")
    ax.set_title(title or "loss by position")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)  # below: curves fill the top
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="eval.jsonl / metrics.jsonl files (or run folders: their eval.jsonl)")
    ap.add_argument("--out", default="loss_by_position.png")
    ap.add_argument("--steps", default="", help="comma-separated steps to draw (default: every evaluation; for "
                                                "metrics.jsonl the last --last steps averaged)")
    ap.add_argument("--last", type=int, default=10)
    ap.add_argument("--labels", default="", help="comma-separated, one per file")
    ap.add_argument("--logx", default="false", choices=["true", "false"])
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    steps = {int(s) for s in args.steps.split(",")} if args.steps else None
    labels = args.labels.split(",") if args.labels else [None] * len(args.files)
    curves = []
    for f, label in zip(args.files, labels, strict=True):
        if os.path.isdir(f):
            f = os.path.join(f, "eval.jsonl")
        curves += curves_from(f, steps, args.last, label)
    plot(curves, args.out, args.title, args.logx == "true")
    for c in curves:
        x = span_middles(c["seq_len"], len(c["y"]))
        print(f"{c['label']}: mean of the last eighth {tail_mean(x, c['y'], c['seq_len']):.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
