"""Books in, token windows out: the data side of million-token training.

A source of books (PG-19 streamed from the Hugging Face hub, local .txt/.jsonl/.parquet files, or a synthetic
corpus with long-range structure) is tokenized book by book in a background thread, the books are laid end to
end with an end-of-text token after each, and that one stream is cut into windows of exactly seq_len + 1 tokens.
A window w gives inputs w[:-1] and labels w[1:].

Windows do not overlap: window j is stream tokens [j·(seq_len+1), (j+1)·(seq_len+1)). The first token of a
window is never a target; at 1M tokens that costs one token in a million, and in exchange windows are disjoint
slices, so data-parallel rank d of D takes windows d, d+D, d+2D, ... and a one-rank run that accumulates
windows 0 and 1 sees exactly what two ranks see in their first step. No padding, no token dropped, and a long
book carries on into the next window. That is packing "concat".

The loader reads documents, (row, Document) from a function of the row to start at: token ids and, per token,
whether it is trained on (a book: every token). Read top to bottom: tokenizers, books, the files they come from,
the loader, the micro-batches a step trains on.

    python -m pytest tests/test_data.py -q
"""
import dataclasses
import itertools
import json
import queue
import sys
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
from huggingface_hub import HfFileSystem

from parallel import agree, all_ok, cp_shard

# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------

class ByteTokenizer:
    """UTF-8 bytes are ids 0..255 and end-of-text is 256: needs no files, for the demo and tests."""
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json of the `tokenizers` library, as every Qwen3 checkpoint ships one."""
    EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|im_end|>")  # Qwen3 base: <|endoftext|> = 151643

    def __init__(self, path: Path):
        self.path, self.tokenizer = path, tokenizers.Tokenizer.from_file(str(path))
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

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


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
    wins. `words` sets that recall distance (measured for a few values: bench/NOTES.md, section "data.py").
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


# A parquet copy of PG-19 (28,602 train books, 11 GB): data/{train,validation,test}-000NN-of-000MM-*.parquet with
# columns short_book_title, publication_date, url, text. The original deepmind/pg19 is a loading script; its
# parquet conversion (revision refs/convert/parquet, default/train/*.parquet) also works here.
DEFAULT_PG19_REPO = "emozilla/pg19"


def known_text(source: str, repo: str = "") -> bool:
    """Whether `source`'s rows are text without reading it: the synthetic corpus, or PG-19 from its default repo.
    (A local file is read first, on rank 0, even a .txt: a missing one is then said once, for every rank.)"""
    return parse_synthetic(source) is not None or (source == "pg19" and repo in ("", DEFAULT_PG19_REPO))


def iter_books(source: str, *, seed: int = 0, start_book: int = 0, repo: str = DEFAULT_PG19_REPO,
               revision: str = "main", split: str = "train",
               text_column: str = "text") -> Iterator[tuple[int, "str | Skipped"]]:
    """(book_index, text) in a fixed order, from book `start_book` on (a .jsonl line that is not JSON: Skipped).

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
    fs, files = files_of(source, split, repo, revision)
    return read_books(fs, files, start_book=start_book, text_column=text_column)


def read_books(fs, paths: list[str], *, start_book: int = 0, text_column: str = "text",
               sleep: Callable[[float], None] = time.sleep) -> Iterator[tuple[int, "str | Skipped"]]:
    """(book_index, text) from the rows of read_rows: one book per row, its field `text_column`.

    A row without that field stops with a ValueError (the text column is the whole configuration of a book
    source, so a missing one is a setting to fix); a line that is not JSON comes through as a Skipped row,
    which the loader logs and counts.
    """
    for index, where, row in read_rows(fs, paths, start_row=start_book, columns=(text_column,), sleep=sleep):
        if not isinstance(row, Skipped) and text_column not in row:
            raise ValueError(f"{where} has no field {text_column!r}; its fields are {sorted(row)} (set text_column)")
        yield index, row if isinstance(row, Skipped) else row[text_column] or ""


# ---------------------------------------------------------------------------------------------
# Files: local, or parquet streamed from the hub, row by row with retries
# ---------------------------------------------------------------------------------------------

SUFFIXES = (".txt", ".jsonl", ".parquet")
SPLITS = ("train", "validation", "test")


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A row left out, and why; the loader writes line() once and counts it."""
    where: str   # "rows.jsonl line 17"
    reason: str

    def line(self) -> str:
        return f"data: {self.where}: {self.reason}; row skipped"


class LocalFiles:
    """Local paths behind the one call the readers make of an fsspec file system (HfFileSystem for the hub)."""

    def open(self, path: str, mode: str = "rb"):
        return open(path, mode)


def files_of(source: str, split: str = "train", repo: str = DEFAULT_PG19_REPO,
             revision: str = "main") -> tuple[object, list[str]]:
    """(fs, paths) of a source: "pg19" is `repo`'s parquet files on the hub, anything else a local file or folder."""
    if source == "pg19":
        fs = HfFileSystem()
        return fs, list_hub_parquet(fs, repo, revision, split)
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"data source {source!r} does not exist; pass 'synthetic', 'pg19', or a path to a "
                                f".txt/.jsonl/.parquet file or a folder of them")
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise ValueError(f"{path}: unsupported file type {path.suffix!r}; expected one of {SUFFIXES}")
        return LocalFiles(), [str(path.resolve())]
    # A downloaded PG-19 data/ folder also holds test-*/validation-* files: leave other splits out.
    files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and _split_prefix(p.name) in (split, None))
    if not files:
        raise ValueError(f"folder {path} holds no {'/'.join(SUFFIXES)} files (of split {split!r})")
    return LocalFiles(), [str(p.resolve()) for p in files]


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


def read_rows(fs, paths: list[str], *, start_row: int = 0, columns: tuple[str, ...] = ("text",),
              sleep: Callable[[float], None] = time.sleep) -> Iterator[tuple[int, str, "dict | Skipped"]]:
    """(row_index, where, row) from .txt/.jsonl/.parquet files opened through `fs`, from row `start_row` on.

    `fs` is any fsspec file system, or anything with its open(path, "rb"): LocalFiles, or an HfFileSystem to
    stream the hub. A row is a dict: a JSON object of a .jsonl line, the `columns` a .parquet file has of those
    asked for (null where a row has none), or {columns[0]: text} for a whole .txt file. `where` names the file
    and the 1-based line (jsonl) or row (parquet) for messages. A line that is not a JSON object comes as a
    Skipped row, so that it keeps its index; a file that is not UTF-8 stops with a ValueError. Parquet is read
    one row group at a time, and whole row groups before `start_row` are skipped by the row counts in the file
    footer without being read.
    """
    index = 0
    for path in paths:
        if path.endswith(".parquet"):
            index = yield from _parquet_rows(fs, path, index, start_row, columns, sleep)
        elif path.endswith(".jsonl"):
            index = yield from _jsonl_rows(fs, path, index, start_row)
        else:  # .txt: the whole file is one row
            if index >= start_row:
                with fs.open(path, "rb") as f:
                    yield index, Path(path).name, {columns[0]: _utf8(f.read(), path)}
            index += 1


def _utf8(data: bytes, path: str, line: int | None = None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        at = f"line {line}, byte {err.start}" if line else f"byte {err.start}"
        raise ValueError(f"{path} is not UTF-8 text ({at}: {data[err.start:err.start + 4]!r}); convert it to "
                         "UTF-8") from None


def _parquet_rows(fs, path, index, start_row, columns, sleep):
    def footer():
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            return pf.schema_arrow.names, [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]

    def row_group(g):  # a fresh handle per row group, so that a retry after a dropped connection starts clean
        with fs.open(path, "rb") as f:
            return pq.ParquetFile(f).read_row_group(g, columns=present).to_pylist()

    names, rows = retry(footer, f"reading the parquet footer of {path}", sleep)
    first = index  # this file's first row
    present = [c for c in dict.fromkeys(columns) if c in names]
    if not present:
        raise ValueError(f"{path} has no column {' or '.join(map(repr, dict.fromkeys(columns)))}; its columns are "
                         f"{names} (set text_column)")
    for g, n in enumerate(rows):
        if index + n > start_row:
            records = retry(lambda: row_group(g), f"reading row group {g} of {path}", sleep)
            for k, record in enumerate(records):
                if index + k >= start_row:
                    yield index + k, f"{Path(path).name} row {index + k - first + 1}", record
        index += n
    return index


def _jsonl_rows(fs, path, index, start_row):
    with fs.open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue  # blank lines are not rows
            if index >= start_row:
                where = f"{Path(path).name} line {line_no}"
                text = _utf8(line, path, line_no).lstrip("\ufeff").rstrip("\r\n")  # a byte-order mark is no part
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as err:
                    record = Skipped(where, f"malformed JSON ({err.msg}: column {err.colno})")
                if not isinstance(record, (dict, Skipped)):
                    record = Skipped(where, f"a JSON {type(record).__name__}, not an object")
                yield index, where, record
            index += 1
    return index


# ---------------------------------------------------------------------------------------------
# Documents and windows
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Document:
    """What the loader reads: ids [n] int64, and trained [n] bool (token i is a target when its label is kept)."""
    ids: np.ndarray
    trained: np.ndarray
    where: str


def tokenized(books: Iterator[tuple[int, "str | Skipped"]], tokenizer) -> Iterator[tuple[int, "Document | Skipped"]]:
    """(index, Document) of each book of iter_books: its tokens then end-of-text, every one trained. Lazy, so the
    loader's thread does the tokenizing; Skipped rows pass through."""
    for index, text in books:
        if isinstance(text, Skipped):
            yield index, text
            continue
        ids = np.asarray(tokenizer.encode(text) + [tokenizer.eos_id], dtype=np.int64)
        yield index, Document(ids, np.ones(len(ids), dtype=bool), f"book {index}")


SKIP_LINES = 100  # skipped rows written out per loader thread; later ones are only counted
POSITION = ("row", "offset", "window", "skipped", "book")  # where a saved stream resumes ("book": older states)


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")  # one write per line: lines of two threads do not run together


class WindowLoader:
    """Iterates over this rank's windows, int64 tensors of shape [seq_len + 1]: documents laid end to end into one
    stream cut into windows of seq_len + 1 tokens. Every token is trained on, so a Document with tokens that are
    not stops with an error. No padding: the tail of finite data shorter than a round of windows is dropped.

    documents(start) must yield (row, item) from row `start` on; it is called again on resume. An item is a
    Document (tokenized(iter_books(...)) gives them) or a Skipped row, which is counted and written out with
    `log` (default: stderr, on dp rank 0 only). A daemon thread reads ahead into a queue of `prefetch` windows.
    In training one loader runs per data-parallel group, on the group's first rank (Batches); it tokenizes the
    whole stream, every group's windows, and copies only its own: tokenizing is seconds per 1M-token window
    against minutes of training.

    A window is handed out only when its whole round of dp_size windows exists, so all ranks yield the same
    number of windows and stop together when finite data runs out (StopIteration). The state after a round is
    then the same on every rank: the stream position (row, token offset in it) where the next round begins, that
    round's first global window, and the rows skipped so far. Saving it from rank 0 is enough, and a run may
    resume on a different number of ranks. A subclass that cuts windows another way overrides windows(start)
    and adds to the state a field naming its way, so that this loader refuses to resume its stream.
    """

    def __init__(self, documents: Callable[[int], Iterator[tuple[int, "Document | Skipped"]]], seq_len: int,
                 dp_rank: int = 0, dp_size: int = 1, prefetch: int = 4, log: Callable[[str], None] | None = None):
        if seq_len < 1 or prefetch < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need seq_len >= 1, prefetch >= 1 and 0 <= dp_rank < dp_size; got seq_len={seq_len}, "
                             f"prefetch={prefetch}, dp_rank={dp_rank}, dp_size={dp_size}")
        self.documents, self.seq_len = documents, seq_len
        self.dp_rank, self.dp_size, self.prefetch = dp_rank, dp_size, prefetch
        self.log = log if log is not None else _say if dp_rank == 0 else (lambda line: None)
        # what has been consumed, not what was prefetched
        self._state = {"row": 0, "offset": 0, "window": 0, "skipped": 0}
        self._thread = self._queue = self._stop = None
        self._final = None  # the StopIteration or error that ended the stream, raised again on every call

    def __iter__(self):
        return self

    def __next__(self):
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
        return value  # [seq_len + 1] int64, or what a subclass's windows() makes

    @property
    def skipped(self) -> int:
        """Rows skipped from the start of the data through the last window handed out (kept across resume)."""
        return self._state["skipped"]

    def state_dict(self) -> dict:
        return dict(self._state, seq_len=self.seq_len)

    def load_state_dict(self, sd: dict) -> None:
        if sd["seq_len"] != self.seq_len:
            raise ValueError(f"the saved stream was cut into windows of {sd['seq_len']} + 1 tokens, not "
                             f"{self.seq_len} + 1; resume with the same seq_len")
        # A field beyond the position names the way a subclass cut the stream ("concat": this way, as states
        # saved before subclasses kept their own field said).
        other = [v for k, v in sd.items() if k not in (*POSITION, "seq_len") and v != "concat"]
        if other:
            raise ValueError(f"the saved stream was packed with {other[0]!r}, not 'concat'; resume with the same "
                             "packing")
        self.close()
        row = sd["row"] if "row" in sd else sd["book"]  # states saved before rows had a name of their own
        self._state = {"row": int(row), "offset": int(sd["offset"]), "window": int(sd["window"]),
                       "skipped": int(sd.get("skipped", 0))}
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
            for window, state in self.windows(start):
                if not put(("window", window, state)):
                    return
            put(("end", StopIteration(), None))
        except BaseException as err:  # handed to the consumer, which raises it: never a hang, never a skip
            put(("error", err, None))

    def read(self, start, seen):
        """(row, Document) of each document from row start["row"] on. Skipped rows are written out and counted in
        seen["skipped"]; seen["rows"] counts every row read and seen["next"] is the row after the last one read."""
        printed = 0
        for row, item in self.documents(start["row"]):
            if seen["rows"] == 0 and row != start["row"]:
                raise ValueError(f"documents({start['row']}) began at row {row}; it must begin at the row asked for")
            seen["rows"], seen["next"] = seen["rows"] + 1, row + 1
            if isinstance(item, Skipped):
                seen["skipped"] += 1
                printed += 1
                if printed <= SKIP_LINES:
                    self.log(item.line() if printed < SKIP_LINES else
                             f"{item.line()} (later skipped rows are counted, not written)")
                continue
            yield row, item

    def windows(self, start):
        """(this rank's window, state after its round), one per round of dp_size windows, from `start`."""
        n, size, rank = self.seq_len + 1, self.dp_size, self.dp_rank
        base = window = start["window"]  # global index of the window being filled
        filled, buf, mine = 0, None, None
        offset, seen, tokens_seen = start["offset"], {"rows": 0, "skipped": start["skipped"]}, 0
        for row, doc in self.read(start, seen):
            if not doc.trained.all():
                raise ValueError(f"{doc.where}: packing 'concat' trains on every token, and this row has tokens that "
                                 "are not trained on: use packing 'docs'")
            tokens = doc.ids
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
                if slot == size - 1:  # the round is complete: the next one starts at (row, pos)
                    yield torch.from_numpy(mine), {"row": row, "offset": pos, "window": window + 1,
                                                   "skipped": seen["skipped"]}
                window, filled = window + 1, 0
        if window - base < size:
            raise ValueError(f"the data ran out before one window per rank: {seen['rows']} books and {tokens_seen} "
                             f"tokens from book {start['row']} on, but {size} rank(s) × (seq_len + 1) = {size * n} "
                             "tokens are needed")


# ---------------------------------------------------------------------------------------------
# Micro-batches for the ranks of a context-parallel group
# ---------------------------------------------------------------------------------------------

class DataEnd(Exception):
    """The (finite) data ran out: the run ends as at --max_steps."""


class DataError(Exception):
    """Reading the data failed mid-run, on some rank; raised on every rank at the same step."""


@dataclasses.dataclass
class Micro:
    """One micro-batch on this rank: its share of one window (parallel.cp_shard)."""
    inputs: torch.Tensor       # [1, T/cp]
    labels: torch.Tensor       # [1, T/cp], -100 where not trained on
    positions: torch.Tensor    # [1, T/cp] RoPE positions in the sequence


class Batches:
    """This rank's micro-batches, [Micro] * grad_accum per step.

    Only the first rank of each context-parallel group reads and tokenizes: make_loader() is called there alone
    (a WindowLoader over this data-parallel group's windows), and each window is broadcast to the rest of the
    group, which shards it (parallel.cp_shard, zigzag). An error on the reading rank stops every rank of the world
    together. A window is seq_len + 1 tokens of one stream, its labels the inputs shifted by one.

    A window crosses the group as one int64 tensor: encode(window) on the reading rank, empty() (of the same
    shape) on the others, and micro(w) makes each rank's share of it. A subclass overrides the three to send
    another kind of window."""

    def __init__(self, make_loader: Callable[[], WindowLoader], seq_len: int, grad_accum: int, cp_group, device):
        self.seq_len, self.grad_accum = seq_len, grad_accum
        self.group, self.device = cp_group, device
        self.cp_rank, self.cp = dist.get_rank(cp_group), dist.get_world_size(cp_group)
        self.src = dist.get_global_rank(cp_group, 0)
        self.positions = self.shard(torch.arange(seq_len, device=device))
        self.loader, error = None, None
        if self.cp_rank == 0:
            try:
                self.loader = make_loader()
            except Exception as e:  # the tokenizers library raises plain Exceptions for a file it cannot parse
                error = f"error (rank {dist.get_rank()}): data: {type(e).__name__}: {str(e).splitlines()[0]}"
        all_ok(error, "setting up the data", device)

    def shard(self, x, layout=None) -> torch.Tensor:
        """[T] -> [1, T/cp]: this rank's chunks of x (parallel.cp_shard; layout None: zigzag)."""
        return cp_shard(x, 0, self.cp_rank, self.cp, layout)[None]

    def empty(self) -> torch.Tensor:
        return torch.empty(self.seq_len + 1, dtype=torch.long)

    def encode(self, window) -> torch.Tensor:
        return window                                                 # [T + 1]

    def micro(self, w) -> Micro:  # [T + 1]: labels shifted on the whole sequence, then sharded
        return Micro(self.shard(w[:-1]), self.shard(w[1:]), self.positions)

    def _window(self) -> torch.Tensor:
        w = self.empty()
        error, ended = None, False
        if self.loader is not None:
            try:
                w = self.encode(next(self.loader))
            except StopIteration:
                ended = True
            except Exception as e:  # every rank must hear of it, or the others hang in the next collective
                error = f"error (rank {dist.get_rank()}): reading data: {type(e).__name__}: {e}"
        all_ok(error, "reading data", self.device, DataError)
        if agree([ended], self.device)[0]:
            raise DataEnd
        w = w.to(self.device)
        dist.broadcast(w, src=self.src, group=self.group)
        return w

    def next(self) -> list[Micro]:
        return [self.micro(self._window()) for _ in range(self.grad_accum)]

    def state_dict(self):  # rank 0 reads the first data-parallel group's windows: its state is everyone's
        return self.loader.state_dict() if self.loader is not None else None

    def load_state_dict(self, sd):
        if self.loader is not None:
            self.loader.load_state_dict(sd)

    @property
    def skipped(self) -> int:
        """Rows skipped so far (bad rows, rows with nothing to train on), on the ranks that read."""
        return self.loader.skipped if self.loader is not None else 0

    def close(self):
        if self.loader is not None:
            self.loader.close()
