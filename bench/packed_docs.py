"""Packed conversations against one long text window, at the same length: what document masks cost under the ring.

    python bench/packed_docs.py --nproc 2 --model qwen3-1.7b --seq_len 131072 --doc_tokens 8192,32768,131072

Writes a tokenizer folder (a byte-level BPE with Qwen3's special tokens and its chat template, from
tests/fixtures) and, per document length, a .jsonl of synthetic conversations of about that many tokens
(user and assistant turns of random words, reasoning on the last turn); then trains train.py on each with
--packing docs, and on the synthetic text corpus with --packing concat, cp = nproc, random init, no checkpoints.
Records s/step (median after the first), peak GPU memory, and the shares of padding and of untrained tokens.
"""
import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PLAN = re.compile(r"offload_layers (\d+)/\d+, keep_attention_layers (\d+)/\d+")
import data  # noqa: E402

WORDS = [w for w in "the of and to in a is that for it as was with be by on not he this are or his from at which "
         "but have an they you were her she there been one all we their has would when if so no what can out "
         "river stone window lantern harbour meadow silver orchard compass thunder velvet ember".split()]


def tokenizer_folder(path):
    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tok.save(os.path.join(path, "tokenizer.json"))
    template = open(os.path.join(ROOT, "tests", "fixtures", "qwen3_chat_template.jinja")).read()
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
               "pad_token": "<|endoftext|>", "chat_template": template},
              open(os.path.join(path, "tokenizer_config.json"), "w"))
    return path


def conversations(path, tok_folder, doc_tokens, total, seed=0):
    """Conversations of about doc_tokens tokens each, totalling >= total tokens."""
    rng, tok = random.Random(seed), data.load_tokenizer(tok_folder)
    per_word = len(tok.encode(" ".join(WORDS))) / len(WORDS)
    with open(path, "w") as fh:
        made = 0
        while made < total:
            turns, words = [], int(doc_tokens / per_word * 0.97)
            while words > 0:
                n = min(words, rng.randint(50, 4000))
                turns.append(" ".join(rng.choice(WORDS) for _ in range(n)))
                words -= n + 8  # the turn's header and end
            if len(turns) % 2:
                turns.append("fine")
            messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
            messages[-1]["reasoning_content"] = "think it over"
            fh.write(json.dumps({"messages": messages}) + "\n")
            made += doc_tokens
    return path


def run(a, name, flags):
    out = os.path.join(a.work, name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}",
           os.path.join(ROOT, "train.py"), "--model", os.path.join(ROOT, "bench", "configs", a.model),
           "--seq_len", str(a.seq_len), "--cp", str(a.nproc), "--max_steps", str(a.steps), "--checkpoints", "false",
           "--resume", "none", "--overwrite", "true", "--out_dir", out, *flags]
    print("$", " ".join(cmd[3:]), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                       timeout=a.timeout)
    for line in p.stdout.splitlines():
        if line.startswith(("step", "model:", "error")):
            print("   ", line[:300], flush=True)
    if p.returncode != 0:
        print(p.stderr[-3000:])
        return dict(name=name, error=p.stderr.strip().splitlines()[-1][:300] if p.stderr.strip() else "failed")
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    timed = rows[1:] or rows
    levers = PLAN.search(p.stdout)  # --fit auto's choice, printed before step 1
    return dict(name=name, s_per_step=statistics.median(r["step_time_s"] for r in timed),
                first_step_s=rows[0]["step_time_s"], peak_mem_gib=max(r["peak_mem_gib"] for r in rows),
                pad_share=rows[-1].get("pad_share"), untrained_share=rows[-1].get("untrained_share"),
                docs_per_window=rows[-1].get("docs"), attn_area=[r.get("attn_area", 1.0) for r in timed],
                levers=[int(x) for x in levers.groups()] if levers else None, losses=[r["loss"] for r in rows])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model", default="qwen3-1.7b")
    ap.add_argument("--seq_len", type=int, default=131072)
    ap.add_argument("--doc_tokens", default="8192,32768,131072")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--work", default="/tmp/packed_docs")
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--extra", default="")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "packed_docs_x2.json"))
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    folder = tokenizer_folder(os.path.join(a.work, "tokenizer"))
    results = [run(a, "concat", ["--tokenizer", "byte", "--data", "synthetic", *a.extra.split()])]
    for n in map(int, a.doc_tokens.split(",")):
        path = conversations(os.path.join(a.work, f"conv_{n}.jsonl"), folder, n, a.seq_len * a.steps * 2)
        results.append(run(a, f"docs_{n}", ["--tokenizer", folder, "--data", path, *a.extra.split()]))
    res = dict(model=a.model, seq_len=a.seq_len, nproc=a.nproc, runs=results)
    print(json.dumps(res, indent=1))
    json.dump(res, open(a.out, "w"), indent=1)
