"""Books in, token windows out: the data side of million-token training.

A source of books (PG-19 streamed from the Hugging Face hub, local .txt/.jsonl/.parquet files, or a synthetic
corpus with long-range structure) is tokenized book by book in a background thread, the books are laid end to
end with an end-of-text token after each, and that one stream is cut into windows of exactly seq_len + 1 tokens.
A window w gives inputs w[:-1] and labels w[1:].

Windows do not overlap: window j is stream tokens [j·(seq_len+1), (j+1)·(seq_len+1)). The first token of a
window is never a target; at 1M tokens that costs one token in a million, and in exchange windows are disjoint
slices, so data-parallel rank d of D takes windows d, d+D, d+2D, ... and a one-rank run that accumulates
windows 0 and 1 sees exactly what two ranks see in their first step. No padding, no token dropped, and a long
book carries on into the next window.

    python data.py synthetic --seq_len 4096 --windows 3              # look at what the loader makes
    python data.py pg19 --tokenizer /path/to/Qwen3-8B --seq_len 1048576
    python -m pytest tests/test_data.py -q
"""
import itertools
import json
import queue
import threading
import time
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import quote

import numpy as np
import pyarrow.parquet as pq
import tokenizers
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem
from huggingface_hub import HfFileSystem

from parallel import agree, all_ok, zigzag_shard

# A parquet copy of PG-19 (28,602 train books, 11 GB): data/{train,validation,test}-000NN-of-000MM-*.parquet with
# columns short_book_title, publication_date, url, text. The original deepmind/pg19 is a loading script; its
# parquet conversion (revision refs/convert/parquet, default/train/*.parquet) also works here.
DEFAULT_PG19_REPO = "emozilla/pg19"
SUFFIXES = (".txt", ".jsonl", ".parquet")
SPLITS = ("train", "validation", "test")


# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------

class ByteTokenizer:
    """UTF-8 bytes are ids 0..255 and end-of-text is 256: needs no files, for the demo and tests."""
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HFTokenizer:
    """A tokenizer.json of the `tokenizers` library, as every Qwen3 checkpoint ships one."""
    EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|im_end|>")  # Qwen3 base: <|endoftext|> = 151643

    def __init__(self, path: Path):
        self.tokenizer = tokenizers.Tokenizer.from_file(str(path))
        # Can be smaller than the model's embedding table (Qwen3: 151,669 vs 151,936 rows); ids stay in range.
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        ids = [i for i in map(self.tokenizer.token_to_id, self.EOS_CANDIDATES) if i is not None]
        if not ids:
            raise ValueError(f"tokenizer {path} has none of the end-of-text tokens {list(self.EOS_CANDIDATES)}, "
                             "which separate books in the stream; use the tokenizer.json of the model you train")
        self.eos_id = ids[0]

    def encode(self, text: str) -> list[int]:
        # No BOS/template tokens: the only special token in the stream is the end-of-text after each book.
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def tokenizer_spec(tokenizer: str, model_path: str | None) -> str:
    """The tokenizer a run uses: --tokenizer if given, else the model folder's tokenizer.json."""
    return tokenizer or model_path or ""


def load_tokenizer(spec: str):
    """'byte', a tokenizer.json, or a folder holding one (a model folder or hub snapshot)."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer at {path}: pass 'byte', a tokenizer.json file or a model folder "
                                "holding one (download a hub model first, e.g. huggingface_hub.snapshot_download)")
    return HFTokenizer(path)


# ---------------------------------------------------------------------------------------------
# Books: synthetic, local files, or PG-19 on the hub
# ---------------------------------------------------------------------------------------------

def synthetic_book(seed: int, index: int, words: int = 800) -> str:
    """Book `index` of the synthetic corpus, a pure function of (seed, index, words) so that skipping books is free.

    words/2 to 3·words/2 Zipf-distributed pseudo-words from a 512-word vocabulary (the default 800: 400-1200
    words, ~3-8k characters), and one passage of 20-45 uniformly drawn words (~100-300 characters) written in the
    first eighth and repeated verbatim twice in the second half. Filler is predictable only from word
    frequencies; the later copies are predictable from far back, so a model that attends that far measurably
    wins. `words` sets that recall distance (median characters from one copy to the next, 100 books, seed 0):
    800 (data source "synthetic"): books of ~6,000 characters, copies 3,360 then 976 apart; 100
    ("synthetic:100"): ~1,300 characters, 625 then 334 apart; 50: ~1,000 characters, 434 then 272 apart.
    """
    if words < 16:
        raise ValueError(f"synthetic books need words >= 16 (the passage goes in the first eighth), got {words}")
    rng = np.random.default_rng(seed)  # the vocabulary, shared by every book of this seed
    lengths, letters = rng.integers(2, 10, size=512), rng.integers(97, 123, size=(512, 9), dtype=np.uint8)
    vocab = [bytes(row[:n]).decode() for row, n in zip(letters, lengths)]
    zipf = 1.0 / np.arange(1, 513)
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(index,)))  # this book's own stream
    n = int(rng.integers(words // 2, 3 * words // 2))
    filler = [vocab[i] for i in rng.choice(512, size=n, p=zipf / zipf.sum())]
    passage = [vocab[i] for i in rng.integers(0, 512, size=int(rng.integers(20, 45)))]
    a, (b, c) = int(rng.integers(0, n // 8)), sorted(int(x) for x in rng.integers(n // 2, n, size=2))
    return " ".join(filler[:a] + passage + filler[a:b] + passage + filler[b:c] + passage + filler[c:])


# The synthetic corpus is endless, so its held-out splits are books no training run reaches: split "validation"
# starts at book 10^9 (5·10^12 characters in), "test" at 2·10^9. Same seed, hence the same vocabulary.
SYNTHETIC_SPLIT_START = {"train": 0, "validation": 10**9, "test": 2 * 10**9}


def parse_synthetic(source: str) -> int | None:
    """'synthetic' -> 800 (words per book, on average), 'synthetic:N' -> N; None for any other source."""
    if source == "synthetic":
        return 800
    if not source.startswith("synthetic:"):
        return None
    try:
        return int(source.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"data source {source!r}: write synthetic:N with N the mean words per book, e.g. "
                         "synthetic:100") from None


def retry(fn: Callable, what: str, sleep: Callable[[float], None] = time.sleep, tries: int = 5):
    """fn(), retried with exponential backoff (1, 2, 4, 8 s); then a RuntimeError that says what to do."""
    for attempt in range(tries):
        try:
            return fn()
        # Mistakes in the data or the request fail at once. Anything else (connection resets, timeouts,
        # HTTP 429/5xx, from whichever HTTP library huggingface_hub uses underneath) is taken as transient.
        except (ValueError, TypeError, LookupError, FileNotFoundError, PermissionError):
            raise
        except Exception as err:
            if attempt == tries - 1:
                raise RuntimeError(
                    f"{what} failed {tries} times (last error: {err!r}). If it is on the Hugging Face hub, the hub "
                    "could not be reached: check the network and HF_TOKEN, or download the data and pass a local "
                    "path with --data") from err
            sleep(2.0 ** attempt)


def list_hub_parquet(fs, repo: str, revision: str = "main", split: str = "train",
                     sleep: Callable[[float], None] = time.sleep) -> list[str]:
    """The parquet files of one split of a hub dataset, sorted: named `{split}-*` or in a folder `{split}/`."""
    root = f"datasets/{repo}@{quote(revision, safe='')}"  # a revision like refs/convert/parquet is URL-encoded
    paths = retry(lambda: fs.glob(f"{root}/**/*.parquet"), f"listing the parquet files of {root}", sleep)
    files = sorted(p for p in paths if _split_prefix(p) == split or p.split("/")[-2] == split)
    if not files:
        raise ValueError(f"no parquet files of split {split!r} in {root} (found {len(paths)} parquet files)")
    return files


def _split_prefix(path: str) -> str | None:
    """'train' for train-00000-of-00023.parquet, train_3.jsonl or train.txt; None when no split is named."""
    prefix = Path(path).name.replace("_", "-").replace(".", "-").split("-")[0]
    return prefix if prefix in SPLITS else None


def read_books(fs, paths: list[str], *, start_book: int = 0, text_column: str = "text",
               sleep: Callable[[float], None] = time.sleep) -> Iterator[tuple[int, str]]:
    """(book_index, text) from .txt/.jsonl/.parquet files opened through `fs`, from book `start_book` on.

    `fs` is any fsspec file system: a LocalFileSystem for local files, an HfFileSystem to stream the hub.
    Parquet is read one row group at a time, and whole row groups before `start_book` are skipped by the row
    counts in the file footer without being read.
    """
    index = 0
    for path in paths:
        if path.endswith(".parquet"):
            index = yield from _parquet_books(fs, path, index, start_book, text_column, sleep)
        elif path.endswith(".jsonl"):
            index = yield from _jsonl_books(fs, path, index, start_book, text_column)
        else:  # .txt: the whole file is one book
            if index >= start_book:
                with fs.open(path, "rb") as f:
                    yield index, f.read().decode("utf-8")
            index += 1


def _parquet_books(fs, path, index, start_book, column, sleep):
    def footer():
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            return pf.schema_arrow.names, [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]

    def row_group(g):  # a fresh handle per row group, so that a retry after a dropped connection starts clean
        with fs.open(path, "rb") as f:
            return pq.ParquetFile(f).read_row_group(g, columns=[column]).column(0).to_pylist()

    names, rows = retry(footer, f"reading the parquet footer of {path}", sleep)
    if column not in names:
        raise ValueError(f"{path} has no column {column!r}; its columns are {names} (set text_column)")
    for g, n in enumerate(rows):
        if index + n > start_book:
            texts = retry(lambda: row_group(g), f"reading row group {g} of {path}", sleep)
            for k, text in enumerate(texts):
                if index + k >= start_book:
                    yield index + k, text or ""
        index += n
    return index


def _jsonl_books(fs, path, index, start_book, column):
    with fs.open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue  # blank lines are not books
            if index >= start_book:
                record = json.loads(line)
                if column not in record:
                    raise ValueError(f"{path} line {line_no} has no field {column!r}; its fields are "
                                     f"{sorted(record)} (set text_column)")
                yield index, record[column]
            index += 1
    return index


def _local_files(source: str, split: str) -> list[str]:
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"data source {source!r} does not exist; pass 'synthetic', 'pg19', or a path to a "
                                f".txt/.jsonl/.parquet file or a folder of them")
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise ValueError(f"{path}: unsupported file type {path.suffix!r}; expected one of {SUFFIXES}")
        return [str(path.resolve())]
    # A downloaded PG-19 data/ folder also holds test-*/validation-* files: leave other splits out.
    files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and _split_prefix(p.name) in (split, None))
    if not files:
        raise ValueError(f"folder {path} holds no {'/'.join(SUFFIXES)} files (of split {split!r})")
    return [str(p.resolve()) for p in files]


def iter_books(source: str, *, seed: int = 0, start_book: int = 0, repo: str = DEFAULT_PG19_REPO,
               revision: str = "main", split: str = "train", text_column: str = "text") -> Iterator[tuple[int, str]]:
    """(book_index, text) in a fixed order, from book `start_book` on.

    source: "synthetic" or "synthetic:N" (infinite, generated from `seed`, books of N words on average; the
    split picks a range of books that the others never reach), "pg19" (streamed from `repo` on the hub), or a
    local .txt file (one book), .jsonl (one book per line, field `text_column`), .parquet (one book per row,
    column `text_column`), or a folder of those, read in sorted name order. `seed` only shapes the synthetic
    corpus; real books come in file order. Paths are checked here, before the first book is read.
    """
    if start_book < 0:
        raise ValueError(f"start_book must be >= 0, got {start_book}")
    words = parse_synthetic(source)
    if words is not None:
        if split not in SYNTHETIC_SPLIT_START:
            raise ValueError(f"split {split!r}: the synthetic corpus has splits {sorted(SYNTHETIC_SPLIT_START)}")
        synthetic_book(seed, 0, words)  # a bad `words` fails here, not in the loader's thread
        first = SYNTHETIC_SPLIT_START[split]  # book indices stay 0-based within the split (resume counts them)
        return ((i, synthetic_book(seed, first + i, words)) for i in itertools.count(start_book))
    if source == "pg19":
        fs = HfFileSystem()
        files = list_hub_parquet(fs, repo, revision, split)
        return read_books(fs, files, start_book=start_book, text_column=text_column)
    return read_books(LocalFileSystem(), _local_files(source, split), start_book=start_book, text_column=text_column)


# ---------------------------------------------------------------------------------------------
# Windows
# ---------------------------------------------------------------------------------------------

class WindowLoader:
    """Iterates over this rank's windows: int64 tensors of shape [seq_len + 1].

    books(start_book) must yield (book_index, text) from book `start_book` on; it is called again on resume.
    A daemon thread tokenizes ahead into a queue of `prefetch` windows. In training one loader runs per
    data-parallel group, on the group's first rank (Batches); it tokenizes the whole stream, every group's
    windows, and copies only its own: tokenizing is seconds per 1M-token window against minutes of training.

    A window is handed out only when its whole round of dp_size windows exists, so all ranks yield the same
    number of windows and stop together when finite data runs out (StopIteration). The state after a round is
    then the same on every rank: the stream position (book, token offset in it) where the next round begins,
    and that round's first global window. Saving it from rank 0 is enough, and a run may resume on a different
    number of ranks.
    """

    def __init__(self, books: Callable[[int], Iterator[tuple[int, str]]], tokenizer, seq_len: int,
                 dp_rank: int = 0, dp_size: int = 1, prefetch: int = 4):
        if seq_len < 1 or prefetch < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need seq_len >= 1, prefetch >= 1 and 0 <= dp_rank < dp_size; got seq_len={seq_len}, "
                             f"prefetch={prefetch}, dp_rank={dp_rank}, dp_size={dp_size}")
        self.books, self.tokenizer, self.seq_len = books, tokenizer, seq_len
        self.dp_rank, self.dp_size, self.prefetch = dp_rank, dp_size, prefetch
        self._state = {"book": 0, "offset": 0, "window": 0}  # what has been consumed, not what was prefetched
        self._thread = self._queue = self._stop = None
        self._final = None  # the StopIteration or error that ended the stream, raised again on every call

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        if self._final is not None:
            raise self._final
        if self._thread is None:
            self._start()
        while True:
            try:
                kind, value, state = self._queue.get(timeout=1.0)
                break
            except queue.Empty:  # the thread always puts a last item; this only guards against a silent hang
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the data thread stopped without a result")
        if kind != "window":
            self._final = value
            raise value
        self._state = state
        return value  # [seq_len + 1] int64

    def state_dict(self) -> dict:
        return dict(self._state, seq_len=self.seq_len)

    def load_state_dict(self, sd: dict) -> None:
        if sd["seq_len"] != self.seq_len:
            raise ValueError(f"the saved stream was cut into windows of {sd['seq_len']} + 1 tokens, not "
                             f"{self.seq_len} + 1; resume with the same seq_len")
        self.close()
        self._state = {"book": int(sd["book"]), "offset": int(sd["offset"]), "window": int(sd["window"])}
        self._final = None

    def close(self) -> None:
        """Stops the thread (it exits at its next queue put); iterating again restarts from the consumed state."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=1.0)  # a thread stuck in a network read is a daemon: it dies with us
            self._thread = None

    def _start(self):
        # Queue and event go to the thread as arguments, so a closed thread can never feed a restarted loader.
        self._queue, self._stop = queue.Queue(maxsize=self.prefetch), threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(dict(self._state), self._queue, self._stop),
                                        name="window-loader", daemon=True)
        self._thread.start()

    def _produce(self, start, out, stop):
        def put(item):  # waits for room in the queue, but gives up as soon as close() asks
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    pass
            return False

        try:
            for window, state in self._windows(start):
                if not put(("window", window, state)):
                    return
            put(("end", StopIteration(), None))
        except BaseException as err:  # handed to the consumer, which raises it: never a hang, never a skip
            put(("error", err, None))

    def _windows(self, start):
        """(this rank's window, state after its round), one per round of dp_size windows, from `start`."""
        n, size, rank, eos = self.seq_len + 1, self.dp_size, self.dp_rank, self.tokenizer.eos_id
        base = window = start["window"]  # global index of the window being filled
        filled, buf, mine = 0, None, None
        offset, books_seen, tokens_seen = start["offset"], 0, 0
        for book, text in self.books(start["book"]):
            if books_seen == 0 and book != start["book"]:
                raise ValueError(f"books({start['book']}) began at book {book}; it must begin at the book asked for")
            books_seen += 1
            tokens = np.asarray(self.tokenizer.encode(text) + [eos], dtype=np.int64)
            pos, offset = offset, 0  # the saved offset applies to the first book only
            tokens_seen += len(tokens) - pos
            while pos < len(tokens):
                slot = (window - base) % size
                take = min(n - filled, len(tokens) - pos)
                if slot == rank:  # other ranks' windows are only counted, never copied
                    if filled == 0:
                        buf = np.empty(n, dtype=np.int64)
                    buf[filled:filled + take] = tokens[pos:pos + take]
                filled, pos = filled + take, pos + take
                if filled < n:
                    break  # this book is used up; the window carries on into the next
                if slot == rank:
                    mine = buf
                if slot == size - 1:  # the round is complete: the next one starts at (book, pos)
                    yield torch.from_numpy(mine), {"book": book, "offset": pos, "window": window + 1}
                window, filled = window + 1, 0
        if window - base < size:
            raise ValueError(f"the data ran out before one window per rank: {books_seen} books and {tokens_seen} "
                             f"tokens from book {start['book']} on, but {size} rank(s) × (seq_len + 1) = {size * n} "
                             "tokens are needed")


# ---------------------------------------------------------------------------------------------
# Micro-batches for the ranks of a context-parallel group
# ---------------------------------------------------------------------------------------------

class DataEnd(Exception):
    """The (finite) data ran out: the run ends as at --max_steps."""


class Batches:
    """This rank's micro-batches, [(inputs [1, T/cp], labels [1, T/cp])] * grad_accum per step.

    Only the first rank of each context-parallel group reads and tokenizes: make_loader() is called there alone
    (a WindowLoader over this data-parallel group's windows), and each window is broadcast to the rest of the
    group, which shards it (zigzag). An error on the reading rank stops every rank of the world together."""

    def __init__(self, make_loader: Callable[[], "WindowLoader"], seq_len: int, grad_accum: int, cp_group, device):
        self.seq_len, self.grad_accum, self.group, self.device = seq_len, grad_accum, cp_group, device
        self.cp_rank, self.cp = dist.get_rank(cp_group), dist.get_world_size(cp_group)
        self.src = dist.get_global_rank(cp_group, 0)
        self.loader, error = None, None
        if self.cp_rank == 0:
            try:
                self.loader = make_loader()
            except Exception as e:  # the tokenizers library raises plain Exceptions for a file it cannot parse
                error = f"error (rank {dist.get_rank()}): data: {type(e).__name__}: {str(e).splitlines()[0]}"
        all_ok(error, "setting up the data", device)

    def _window(self):
        w, error, ended = torch.empty(self.seq_len + 1, dtype=torch.long), None, False
        if self.loader is not None:
            try:
                w = next(self.loader)
            except StopIteration:
                ended = True
            except Exception as e:  # every rank must hear of it, or the others hang in the next collective
                error = f"error (rank {dist.get_rank()}): reading data: {type(e).__name__}: {e}"
        all_ok(error, "reading data", self.device)
        if agree([ended], self.device)[0]:
            raise DataEnd
        w = w.to(self.device)
        dist.broadcast(w, src=self.src, group=self.group)
        return w

    def next(self):
        batch = []
        for _ in range(self.grad_accum):
            w = self._window()                                            # [T + 1], the whole sequence
            inputs = zigzag_shard(w[:-1], 0, self.cp_rank, self.cp)[None]  # [1, T/cp]
            labels = zigzag_shard(w[1:], 0, self.cp_rank, self.cp)[None]   # shifted on the whole sequence, then sharded
            batch.append((inputs, labels))
        return batch

    def state_dict(self):  # rank 0 reads the first data-parallel group's windows: its state is everyone's
        return self.loader.state_dict() if self.loader is not None else None

    def load_state_dict(self, sd):
        if self.loader is not None:
            self.loader.load_state_dict(sd)

    def close(self):
        if self.loader is not None:
            self.loader.close()


if __name__ == "__main__":  # print what the loader makes of a source: tokens, book ends, time, state
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("source", nargs="?", default="synthetic")  # synthetic | pg19 | a local path
    parser.add_argument("--tokenizer", default="byte")  # byte | a tokenizer.json | a model folder
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--windows", type=int, default=3)
    args, t0 = parser.parse_args(), time.perf_counter()
    tok = load_tokenizer(args.tokenizer)
    loader = WindowLoader(lambda b: iter_books(args.source, start_book=b), tok, args.seq_len)
    for _, w in zip(range(args.windows), loader):
        print(f"{w.numel()} tokens, {int((w == tok.eos_id).sum())} book ends, {time.perf_counter() - t0:.2f} s, "
              f"state {loader.state_dict()}")
    loader.close()
