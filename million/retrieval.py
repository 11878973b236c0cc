"""Does the model use its context? A needle-in-a-haystack retrieval test, scored by the evaluation's forward.

Needles, sentences such as "The amber passkey is 48213.", are laid into held-out text at chosen depths (fractions
of the text), and their questions are asked in turn at the end, each followed by its answer: RULER's
multi-key form, where one haystack and one forward score many depths. Nothing is generated: the window goes
through one teacher-forced forward under the ring, sharded as train.py's evaluation shards it, and only the
answer rows meet the head (their final hidden states @ the head weight: never [L x V] logits). A key is
retrieved when each of its tokens is the argmax given the tokens before it, which is what greedy decoding would
write; its mean NLL comes beside it. A cell of the grid is (length, depth), scored over --retrieval_keys needles.

    torchrun --nproc_per_node 8 train.py --eval_every 100 --retrieval true   # out_dir/retrieval.jsonl and .png
    python bench/retrieval_small.py      # a tiny Qwen3 trained on passkeys at L, tested up to 8L (CPU, minutes)
    python -m pytest tests/test_retrieval.py -q

Sections: the task (text, needles, keys, windows), scoring under the ring, the evaluation (grid, log, picture).
"""
import dataclasses
import math
import os
import re
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from million import chat
import data
import parallel
from million import plan
from million import rundir
from loss import mm_fp32

# Each needle of a haystack has its own name, so that its question asks for it alone.
NAMES = ("amber", "birch", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "jasper", "kestrel",
         "lotus", "maple", "nectar", "onyx", "pebble", "quartz", "raven", "sierra", "tundra", "umber", "velvet",
         "willow", "xenon", "yarrow", "zephyr")
KEY_DIGITS = 5         # keys 10000..99999: guessed at random, one in 90,000
NEEDLE_SHARE = 0.25    # needles and questions take at most this share of a window; more needles, more windows
SENTENCE_WORDS = 16    # text without sentence ends (the synthetic corpus) is cut into pieces of at most this many

# =============================================================================================
# 1. The task: held-out text in sentences, needles with keys, their questions, windows of exact length
# =============================================================================================


def sentences(text: str) -> list[str]:
    """The text cut after each ., ! or ?, and pieces of more than SENTENCE_WORDS words into equal parts."""
    out = []
    for piece in re.split(r"(?<=[.!?])\s+", text):
        words = piece.split()
        parts = -(-len(words) // SENTENCE_WORDS)
        out += [" ".join(words[i * len(words) // parts:(i + 1) * len(words) // parts]) for i in range(parts)]
    return out


def filler(books, tok):
    """(token ids, text) of each sentence of the books, every one tokenized alone with its leading space, so that
    a needle fits between two sentences without changing their tokens."""
    for text in books:
        for s in sentences(text):
            ids = tok.encode(" " + s)
            if ids:
                yield ids, s


def book_stream(source: str, split: str, seed: int, start: int, **kw):
    """The texts of `source` from book `start` on, starting over from the first when the source ends; kw: the
    rest of data.iter_books's arguments (repo, revision, text_column)."""
    first = True
    while True:
        empty = True
        for _, text in data.iter_books(source, seed=seed, start_book=start if first else 0, split=split, **kw):
            if isinstance(text, str) and text.strip():
                empty = False
                yield text
        if empty and not first:
            raise ValueError(f"retrieval: {source} ({split}) holds no text to make a haystack of")
        first = False


def draw_keys(rng, n: int, text: str, tries: int = 1000) -> list[str]:
    """n distinct keys of KEY_DIGITS digits, none of which occurs in `text` (the haystack's filler), re-drawn
    until so: a key the filler already holds could be answered without the needle."""
    keys = []
    for _ in range(n):
        for _ in range(tries):
            key = str(int(rng.integers(10 ** (KEY_DIGITS - 1), 10 ** KEY_DIGITS)))
            if key not in text and key not in keys:
                keys.append(key)
                break
        else:
            raise ValueError(f"retrieval: no key of {KEY_DIGITS} digits absent from the haystack in {tries} draws")
    return keys


# A window is written as pieces: text (tokenized alone), the haystack, or an answer (a key's tokens). The plain
# form is the pieces below; the chat form renders the same conversation through the chat template.
HAY, KEY = "\uf8f4", "\uf8f5"  # markers in a rendered conversation (private-use characters); KEY is followed by
                               # the number of its question


def needle_pieces(name: str):
    """(before, after) the key in the needle sentence; the key goes between, with its leading space."""
    return f" The {name} passkey is", "."


def question(name: str) -> str:
    return f"What is the {name} passkey?"


def answer_prefix(name: str) -> str:
    return f"The {name} passkey is"


def plain_pieces(names: list[str]) -> list:
    """The plain form: the haystack, then each question with its answer in turn."""
    out = [HAY]
    for i, name in enumerate(names):
        out += [f"\n{question(name)} {answer_prefix(name)}", KEY + str(i), "."]
    return out


def chat_renderer(folder):
    """render(messages) -> text through the chat template of a tokenizer's folder, with the variables training's
    conversations are rendered with."""
    template, variables = chat.load_chat_template(folder), chat.template_variables(folder)
    return lambda messages: chat.render_chat(template, messages, **variables)


def chat_pieces(names: list[str], render) -> list:
    """The chat form: the haystack and the first question in the first user turn, each answer an assistant
    turn, each later question a user turn; rendered once (render: chat_renderer's) and cut at the markers."""
    messages = []
    for i, name in enumerate(names):
        messages.append({"role": "user", "content": (HAY + "\n\n" if i == 0 else "") + question(name)})
        messages.append({"role": "assistant", "content": f"{answer_prefix(name)}{KEY}{i}."})
    out = [p for p in re.split(f"({HAY}|{KEY}\\d+)", render(messages)) if p]
    if out.count(HAY) != 1 or sum(p.startswith(KEY) for p in out) != len(names):
        raise ValueError("retrieval: the chat template did not keep the conversation's text as given")
    return out


@dataclasses.dataclass
class Needle:
    name: str
    key: str
    depth: float        # as asked: a fraction of the filler, placed at the nearest sentence boundary
    start: int          # the needle's first token in the window
    boundary: int       # the filler tokens before it
    answer: tuple       # [a, b): the window positions of the answer's tokens, the targets


@dataclasses.dataclass
class Window:
    """A haystack and its questions: `length` tokens the model reads, then end-of-text (ids[-1])."""
    ids: torch.Tensor   # [length + 1] int64
    needles: list
    length: int
    filler: int         # filler tokens (the haystack less its needles)
    haystack: tuple     # [a, b): the haystack's tokens in the window (filler and needles)

    def labels(self) -> torch.Tensor:
        """[length] the answer tokens as the targets of the rows before them, -100 elsewhere."""
        out = torch.full((self.length,), -100, dtype=torch.long)
        for n in self.needles:
            a, b = n.answer
            out[a - 1:b - 1] = self.ids[a:b]
        return out


def build_window(tok, sents, length: int, depths: list[float], rng, render=None) -> Window:
    """One window of exactly `length` tokens (and end-of-text): filler sentences from the iterator `sents` with a
    needle at each depth (at the sentence boundary nearest to depth x the filler), then the questions in a
    random order, each with its answer. render: chat_renderer's for the chat form, None for the plain one."""
    names = [NAMES[i] for i in rng.choice(len(NAMES), len(depths), replace=False)]
    order = rng.permutation(len(depths))  # the needle each question asks for, in turn
    pool, total = [], 0  # the sentences a window of filler alone would take: no key may occur in any of them
    while total < length:
        pool.append(next(sents))
        total += len(pool[-1][0])
    keys = draw_keys(rng, len(depths), " ".join(text for _, text in pool))
    key_ids = [tok.encode(" " + k) for k in keys]
    needles = [tok.encode(needle_pieces(n)[0]) + k + tok.encode(needle_pieces(n)[1]) for n, k in zip(names, key_ids)]
    asked = [names[j] for j in order]
    parts = []  # ("hay",), ("key", needle) or ("text", ids)
    for p in plain_pieces(asked) if render is None else chat_pieces(asked, render):
        parts.append(("hay",) if p == HAY else ("key", int(order[int(p[1:])])) if p.startswith(KEY)
                     else ("text", tok.encode(p)))
    fixed = sum(len(p[1]) if p[0] == "text" else len(key_ids[p[1]]) if p[0] == "key" else 0 for p in parts)
    budget = length - fixed - sum(map(len, needles))  # filler tokens
    if budget < 1:
        raise ValueError(f"retrieval: {len(depths)} needle(s) and their questions take {length - budget} tokens, "
                         f"more than a window of {length}: fewer depths per window, or longer windows")
    hay, starts, at = lay_needles(cut(pool, budget), needles, depths, budget)
    ids, answers, offset = [], [None] * len(depths), 0
    for p in parts:
        if p[0] == "hay":
            offset = len(ids)
            ids += hay
        elif p[0] == "key":
            answers[p[1]] = (len(ids), len(ids) + len(key_ids[p[1]]))
            ids += key_ids[p[1]]
        else:
            ids += p[1]
    found = [Needle(names[j], keys[j], depths[j], offset + starts[j], at[j], answers[j]) for j in range(len(depths))]
    return Window(torch.tensor(ids + [tok.eos_id], dtype=torch.long), found, length, budget,
                  (offset, offset + len(hay)))


def cut(pool: list, budget: int) -> list[list[int]]:
    """The first sentences of the pool holding exactly `budget` tokens, the last one cut short."""
    out, used = [], 0
    for ids, _ in pool:
        out.append(ids[:budget - used])
        used += len(out[-1])
        if used == budget:
            return out
    raise ValueError(f"retrieval: {used} filler tokens, {budget} needed")


def lay_needles(sents: list[list[int]], needles: list[list[int]], depths: list[float], budget: int):
    """The haystack: the filler sentences with needle j before the boundary nearest to depths[j] x budget.
    -> (ids, each needle's first token, each needle's boundary in filler tokens)."""
    bounds = np.cumsum([0] + [len(s) for s in sents])                              # [sentences + 1]
    at = [int(bounds[np.abs(bounds - d * budget).argmin()]) for d in depths]
    here = {}
    for j in sorted(range(len(depths)), key=lambda j: depths[j]):
        here.setdefault(at[j], []).append(j)
    ids, starts = [], [0] * len(depths)
    for s, b in enumerate(bounds.tolist()):
        for j in here.get(b, ()):
            starts[j] = len(ids)
            ids += needles[j]
        if s < len(sents):
            ids += sents[s]
    return ids, starts, at


# =============================================================================================
# 2. Scoring: one forward per window under the ring, the head on the answer rows alone
# =============================================================================================

def row_logits(model, hidden):
    """hidden [n, H] @ the head's weight.T -> [n, V] fp32 logits of a few rows: the answer rows alone, never
    [T, V]. Under FSDP2 the root is gathered for it and resharded after (parallel.shard_model gathers it in the
    forward alone)."""
    fsdp = hasattr(model, "unshard")
    if fsdp:
        model.unshard()
    logits = mm_fp32(hidden, model.head_weight().T)
    if fsdp:
        model.reshard()
    return logits


def answer_rows(w: Window) -> torch.Tensor:
    """[n] the rows (input positions) whose targets are answer tokens, in order."""
    return (w.labels() != -100).nonzero().squeeze(1)


@torch.no_grad()
def score(model, windows: list[Window], cp_group=None, dp_rank: int = 0, dp: int = 1, device="cpu"):
    """Each window's answer rows (answer_rows): -> [(nll [n] float64, argmax [n] int64)], the same on every rank.

    A window goes through the model sharded over the ranks of cp_group (zigzag, as train.py's evaluation shards
    a sequence); the data-parallel group dp_rank of dp takes windows dp_rank, dp_rank + dp, ..., and runs the
    first window of a round again where it has none left, so that every rank runs FSDP's collectives in step.
    Each rank writes its own answer rows' scores into one buffer, summed over all ranks at the end."""
    rank, world = (dist.get_rank(cp_group), dist.get_world_size(cp_group)) if cp_group is not None else (0, 1)
    rows = [answer_rows(w) for w in windows]
    offsets = np.cumsum([0] + [len(r) for r in rows]).tolist()
    buf = torch.zeros(2, offsets[-1], dtype=torch.float64, device=device)  # [nll, argmax] of every answer row
    for first in range(0, len(windows), dp):
        i = first + dp_rank if first + dp_rank < len(windows) else first
        w = windows[i]
        index = torch.full((w.length,), -1, dtype=torch.long)                      # [L] answer row -> its number
        index[rows[i]] = torch.arange(len(rows[i]))
        inputs, labels, index, pos = (parallel.cp_shard(x, 0, rank, world).to(device)
                                      for x in (w.ids[:-1], w.labels(), index, torch.arange(w.length)))
        h = model(inputs[None], pos[None])[0]                                      # [L/cp, H]
        mine = (index >= 0).nonzero().squeeze(1)                                   # this rank's answer rows
        logits = row_logits(model, h.index_select(0, mine))                       # [m, V] fp32
        nll = torch.logsumexp(logits, 1) - logits.gather(1, labels[mine, None]).squeeze(1)
        if i == first + dp_rank:  # not a repeat
            at = offsets[i] + index[mine]
            buf[0, at], buf[1, at] = nll.double(), logits.argmax(1).double()
    if dist.is_initialized():
        dist.all_reduce(buf)
    return [(buf[0, a:b].cpu(), buf[1, a:b].long().cpu()) for a, b in zip(offsets, offsets[1:])]


def needle_scores(w: Window, nll: torch.Tensor, argmax: torch.Tensor) -> list[tuple[bool, float]]:
    """Per needle: (retrieved: every answer token is the argmax, the answer's mean NLL)."""
    rows = answer_rows(w).tolist()
    where = {r: j for j, r in enumerate(rows)}
    out = []
    for n in w.needles:
        a, b = n.answer
        js = [where[r] for r in range(a - 1, b - 1)]
        out.append((all(int(argmax[j]) == int(w.ids[rows[j] + 1]) for j in js), float(nll[js].mean())))
    return out


# =============================================================================================
# 3. The evaluation: the grid, the windows, one row per evaluation, the log line and the picture
# =============================================================================================

@dataclasses.dataclass
class Grid:
    lengths: list     # window lengths in tokens
    depths: list      # fractions of the haystack
    keys: int         # needles per cell
    needles: int = 0  # needles per window at most; 0: as many as fit in NEEDLE_SHARE of it


def parse_grid(lengths: str, depths: str, keys: int, needles: int, seq_len: int, cp: int) -> Grid:
    """The flags --retrieval_lengths ("" = seq_len), --retrieval_depths, --retrieval_keys and --retrieval_needles;
    a ValueError says what is wrong with them."""
    try:
        ls = [int(x.replace("_", "")) for x in lengths.split(",")] if lengths.strip() else [seq_len]
        ds = [float(x) for x in depths.split(",")]
    except ValueError:
        raise ValueError(f"--retrieval_lengths {lengths!r} and --retrieval_depths {depths!r}: numbers separated by "
                         "commas, e.g. 131072,262144 and 0,0.5,1") from None
    if any(n < 1 or n % (2 * cp) for n in ls):
        raise ValueError(f"--retrieval_lengths {lengths!r}: each a positive multiple of 2*cp = {2 * cp}")
    if not ds or any(not 0 <= d <= 1 for d in ds) or len(set(ds)) < len(ds) or len(ds) > len(NAMES):
        raise ValueError(f"--retrieval_depths {depths!r}: 1 to {len(NAMES)} distinct fractions in [0, 1]")
    if keys < 1 or needles < 0:
        raise ValueError(f"--retrieval_keys {keys} (at least 1) and --retrieval_needles {needles} (0 or more)")
    return Grid(ls, ds, keys, needles)


def needle_tokens(tok) -> int:
    """About what one needle costs a window in the plain form: the needle, its question, its answer."""
    name, key = max(NAMES, key=len), "9" * KEY_DIGITS
    before, after = needle_pieces(name)
    return len(tok.encode(f"{before} {key}{after}")) + len(tok.encode(f"\n{question(name)} {answer_prefix(name)} "
                                                                      f"{key}."))


def build_windows(tok, grid: Grid, source: str, split: str, seed: int, render=None, **kw) -> list[Window]:
    """Every window of the grid, the same at every evaluation. A window holds grid.needles of the depths, or as
    many as fit in NEEDLE_SHARE of it (all of them at training lengths), so a length takes keys x ceil(depths /
    that) windows; window j of a length reads its filler from book j of the source on (kw: book_stream's)."""
    out, cost = [], needle_tokens(tok)
    for length in grid.lengths:
        per = grid.needles or max(1, int(NEEDLE_SHARE * length) // cost)
        groups = -(-len(grid.depths) // per)
        for k in range(grid.keys):
            for g in range(groups):
                j = k * groups + g
                rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(length, j)))
                sents = filler(book_stream(source, split, seed, j, **kw), tok)
                out.append(build_window(tok, sents, length, grid.depths[g::groups], rng, render))
    return out


def cells(windows: list[Window], scores) -> list[dict]:
    """One dict per (length, depth): the needles there, the share retrieved, their mean NLL."""
    acc = {}
    for w, (nll, argmax) in zip(windows, scores):
        for n, (hit, loss) in zip(w.needles, needle_scores(w, nll, argmax)):
            acc.setdefault((w.length, n.depth), []).append((hit, loss))
    return [dict(length=length, depth=depth, keys=len(v), exact_match=sum(h for h, _ in v) / len(v),
                 nll=sum(x for _, x in v) / len(v)) for (length, depth), v in sorted(acc.items())]


def by_length(cs: list[dict]) -> list[dict]:
    out = []
    for length in sorted({c["length"] for c in cs}):
        mine = [c for c in cs if c["length"] == length]
        keys = sum(c["keys"] for c in mine)
        out.append(dict(length=length, exact_match=sum(c["exact_match"] * c["keys"] for c in mine) / keys,
                        nll=sum(c["nll"] * c["keys"] for c in mine) / keys))
    return out


def summary(step: int, row: dict) -> str:
    """The log line: exact match (and NLL) by length, the windows, the time."""
    parts = [f"{x['length']:,}: {x['exact_match']:.0%} (nll {x['nll']:.2f})" for x in row["by_length"]]
    predicted = f", predicted {row['predicted_s']:.1f} s" if row.get("predicted_s") else ""
    return (f"retrieval {step:4d} | exact match by length: " + ", ".join(parts)
            + f" | {row['windows']} windows, {row['time_s']:.1f} s{predicted}")


def forward_seconds(shape: "plan.Shape", windows: list[Window], dp: int) -> float:
    """The cost model's time of the windows' forwards, dp at a time."""
    times = [plan.forward_seconds(dataclasses.replace(shape, seq_len=w.length)) for w in windows]
    return sum(max(times[i:i + dp]) for i in range(0, len(times), dp))


def plot(panels: list[tuple[str, list[dict]]], path: str, title: str = "") -> str | None:
    """A heatmap of exact match, length (rows) x depth (columns), per panel (title, cells) -> path, or None
    when matplotlib is missing (it is for pictures only, not a dependency)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels) + 1, 3.6), squeeze=False)
    fig.subplots_adjust(wspace=0.3)
    for i, (ax, (name, cs)) in enumerate(zip(axes[0], panels)):
        lengths, depths = sorted({c["length"] for c in cs}), sorted({c["depth"] for c in cs})
        grid = np.full((len(lengths), len(depths)), np.nan)
        for c in cs:
            grid[lengths.index(c["length"]), depths.index(c["depth"])] = c["exact_match"]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        for (r, d), v in np.ndenumerate(grid):
            if not math.isnan(v):
                ax.text(d, r, f"{v:.0%}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_yticks(range(len(lengths)), [f"{n:,}" for n in lengths])
        ax.set_xlabel("depth of the needle")
        if i == 0:
            ax.set_ylabel("window (tokens)")
        ax.set_title(name, fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), label="exact match")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def share(windows, device) -> list[Window]:
    """Rank 0's windows on every rank: their ids in one broadcast, the rest as objects."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return windows
    meta = [[dataclasses.replace(w, ids=None) for w in windows] if windows is not None else None]
    dist.broadcast_object_list(meta, src=0, device=device)
    ids = (torch.cat([w.ids for w in windows]) if windows is not None
           else torch.empty(sum(w.length + 1 for w in meta[0]), dtype=torch.long)).to(device)
    dist.broadcast(ids, src=0)
    parts = ids.cpu().split([w.length + 1 for w in meta[0]])
    return [dataclasses.replace(w, ids=t) for w, t in zip(meta[0], parts)]


def run(cfg, s, step: int, log, shape=None, write: bool = True) -> dict | None:
    """The test at train.py's evaluation (--retrieval true): the windows built on rank 0 from --retrieval_data
    (default: the evaluation's books) and shared, scored by s.model under the ring, then on rank 0 a row in
    out_dir/retrieval.jsonl, the picture out_dir/retrieval.png (write_files; write=False leaves them to the
    caller) and one log line. shape: plan.Shape of the run, for the predicted time (None: none predicted). -> the
    row on rank 0, None elsewhere."""
    t0, rank = time.time(), dist.get_rank()
    source = cfg.retrieval_data or cfg.eval_data or cfg.data
    grid = parse_grid(cfg.retrieval_lengths, cfg.retrieval_depths, cfg.retrieval_keys, cfg.retrieval_needles,
                      cfg.seq_len, s.mesh.size(1))
    windows, error, chat_form = None, None, False
    if rank == 0:
        try:
            tok = data.load_tokenizer(data.tokenizer_spec(cfg.tokenizer, s.model_path))
            chat_form = chat_wanted(cfg, tok)
            render = chat_renderer(chat.model_folder(tok)) if chat_form else None
            kw = dict(revision=cfg.data_revision, text_column=cfg.data_column, **(
                {"repo": cfg.data_repo} if cfg.data_repo else {}))
            windows = build_windows(tok, grid, source, cfg.eval_split, cfg.seed, render, **kw)
        except Exception as e:
            error = (f"error: --retrieval, the haystack's text from {source} ({cfg.eval_split}): {type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''}; --retrieval_data names another source of text")
    parallel.all_ok(error, "building the retrieval test", s.device)
    windows = share(windows, s.device)
    scores = score(s.model, windows, s.mesh.get_group("cp"), s.mesh.get_local_rank("dp"), s.mesh.size(0), s.device)
    if rank != 0:
        return None
    cs = cells(windows, scores)
    row = dict(step=step, model=cfg.model, rope_scaling=s.mcfg.rope_scaling, data=source, split=cfg.eval_split,
               chat=chat_form, windows=len(windows), time_s=time.time() - t0,
               predicted_s=forward_seconds(shape, windows, s.mesh.size(0)) if shape is not None else None,
               by_length=by_length(cs), cells=cs)
    log(summary(step, row))
    if write:
        write_files(cfg, row, log)
    return row


def write_files(cfg, row: dict, log):
    """Rank 0: the row into out_dir/retrieval.jsonl and its picture into out_dir/retrieval.png."""
    step = row["step"]
    os.makedirs(cfg.out_dir, exist_ok=True)
    # rows of later steps go, as in metrics.jsonl, when a resumed run evaluates again; --eval_only adds its row
    rows = rundir.JsonlLog(os.path.join(cfg.out_dir, "retrieval.jsonl"), sys.maxsize if cfg.eval_only else step - 1)
    rows.write(row)
    rows.file.close()
    name = f"step {step}, rope_scaling {row['rope_scaling']}"
    if plot([(name, row["cells"])], os.path.join(cfg.out_dir, "retrieval.png")) is None:
        log("retrieval: no picture (matplotlib is not installed); the numbers are in retrieval.jsonl")


def chat_wanted(cfg, tok) -> bool:
    """--retrieval_chat: true, false, or auto: the chat form when the run packs documents (conversations) and its
    tokenizer's folder has a chat template."""
    if cfg.retrieval_chat != "auto":
        return cfg.retrieval_chat == "true"
    packing = cfg.packing if cfg.packing != "auto" else chat.default_packing(
        cfg.data, split=cfg.data_split, text_column=cfg.data_column, revision=cfg.data_revision,
        **({"repo": cfg.data_repo} if cfg.data_repo else {}))
    if packing != "docs" or chat.model_folder(tok) is None:
        return False
    try:
        chat_renderer(chat.model_folder(tok))
    except FileNotFoundError:
        return False
    return True
