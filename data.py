"""Books in, token windows out: the data side of million-token training.

A source of books (PG-19 streamed from the Hugging Face hub, local .txt/.jsonl/.parquet files, or a synthetic
corpus with long-range structure) is tokenized book by book in a background thread, the books are laid end to
end with an end-of-text token after each, and that one stream is cut into windows of exactly seq_len + 1 tokens.
A window w gives inputs w[:-1] and labels w[1:].

Windows do not overlap: window j is stream tokens [j·(seq_len+1), (j+1)·(seq_len+1)). The first token of a
window is never a target; at 1M tokens that costs one token in a million, and in exchange windows are disjoint
slices, so data-parallel rank d of D takes windows d, d+D, d+2D, ... and a one-rank run that accumulates
windows 0 and 1 sees exactly what two ranks see in their first step. No padding, no token dropped, and a long
book carries on into the next window. That is packing "concat", the default for text.

Conversations are rows too: {"messages": [...], "tools": [...]} or TRL's {"prompt": ..., "completion": ...},
told apart per row by their keys. A conversation is rendered with the model's chat template exactly as
transformers' apply_chat_template renders it, tokenized once, and only some tokens are trained on (by default
each assistant turn's content and its <|im_end|>, or a prompt's completion). Such rows are packed "docs": each
row is a document, documents are laid end to end into windows of seq_len (input, label) pairs, a query sees only
its own document, and positions restart at each document (Window, doc_positions). A row that cannot be trained on
is skipped with one line naming its file and line, and counted; a file that is not UTF-8 stops.

    python data.py synthetic --seq_len 4096 --windows 3              # look at what the loader makes
    python data.py pg19 --tokenizer /path/to/Qwen3-8B --seq_len 1048576
    python data.py chats.jsonl --tokenizer /path/to/Qwen3-8B --seq_len 32768   # trained tokens shown in [[ ]]
    python -m pytest tests/test_data.py tests/test_rows.py -q
"""
import dataclasses
import functools
import itertools
import json
import queue
import re
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import quote

import jinja2
import jinja2.ext
import numpy as np
import pyarrow.parquet as pq
import tokenizers
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem
from huggingface_hub import HfFileSystem
from jinja2.sandbox import ImmutableSandboxedEnvironment

from parallel import agree, all_ok, cp_shard

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

    folder = None  # no model folder, hence no chat template of its own

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """ids [n] int64 and each byte's character span [n, 2]: a character starts at each byte that is not a
        UTF-8 continuation byte (0b10xxxxxx)."""
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        char = np.cumsum((ids & 0xC0) != 0x80) - 1
        return ids, np.stack([char, char + 1], 1)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json of the `tokenizers` library, as every Qwen3 checkpoint ships one."""
    EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|im_end|>")  # Qwen3 base: <|endoftext|> = 151643

    def __init__(self, path: Path):
        self.tokenizer = tokenizers.Tokenizer.from_file(str(path))
        self.folder = path.parent  # where load_chat_template looks
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

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """ids [n] int64 and character spans [n, 2] of one encoding of `text` (no special tokens added): what
        apply_chat_template(tokenize=True) makes of a rendered conversation."""
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, dtype=np.int64), np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)

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


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A row left out, and why; the loader writes line() once and counts it."""
    where: str   # "rows.jsonl line 17"
    reason: str

    def line(self) -> str:
        return f"data: {self.where}: {self.reason}; row skipped"


def read_rows(fs, paths: list[str], *, start_row: int = 0, columns: tuple[str, ...] = ("text",),
              sleep: Callable[[float], None] = time.sleep) -> Iterator[tuple[int, str, "dict | Skipped"]]:
    """(row_index, where, row) from .txt/.jsonl/.parquet files opened through `fs`, from row `start_row` on.

    `fs` is any fsspec file system: a LocalFileSystem for local files, an HfFileSystem to stream the hub. A row
    is a dict: a JSON object of a .jsonl line, the `columns` a .parquet file has of those asked for (null where
    a row has none), or {columns[0]: text} for a whole .txt file. `where` names the file and the 1-based line
    (jsonl) or row (parquet) for messages. A line that is not a JSON object comes as a Skipped row, so that it
    keeps its index; a file that is not UTF-8 stops with a ValueError. Parquet is read one row group at a time,
    and whole row groups before `start_row` are skipped by the row counts in the file footer without being read.
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
    if source == "pg19":
        fs = HfFileSystem()
        files = list_hub_parquet(fs, repo, revision, split)
        return read_books(fs, files, start_book=start_book, text_column=text_column)
    return read_books(LocalFileSystem(), _local_files(source, split), start_book=start_book, text_column=text_column)


# ---------------------------------------------------------------------------------------------
# Rows: text, conversations, prompt/completion -> documents (token ids and which of them are trained on)
# ---------------------------------------------------------------------------------------------

ROLES = ("system", "user", "assistant", "tool")
ROW_FIELDS = ("messages", "tools", "prompt", "completion", "chat_template_kwargs")  # read besides the text column
TEMPLATE_FILE = "chat_template.jinja"


class RowError(ValueError):
    """A row that cannot be trained on: it is skipped with one line and counted, and the data goes on."""


@dataclasses.dataclass(frozen=True)
class Document:
    """One row, tokenized: ids [n] int64, and trained [n] bool (token i is a target when its label is kept)."""
    ids: np.ndarray
    trained: np.ndarray
    where: str


def row_format(row: dict, text_column: str = "text") -> str:
    """'messages', 'prompt_completion' or 'text', from the row's keys (a key holding null counts as absent)."""
    has = {k for k, v in row.items() if v is not None}
    if "messages" in has:
        return "messages"
    if {"prompt", "completion"} <= has:
        return "prompt_completion"
    if text_column in has:
        return "text"
    nulls = sorted(set(row) - has)
    raise RowError(f"no field {text_column!r}, 'messages', or 'prompt' and 'completion'; its fields are "
                   f"{sorted(has)}" + (f" and null {nulls}" if nulls else ""))


def load_chat_template(folder) -> str:
    """The chat template of a model folder, from where transformers 5 takes it: chat_template.jinja if there is
    one, else the "chat_template" of tokenizer_config.json (a string, or a list of {name, template} of which
    the one named "default" is used)."""
    folder = Path(folder)
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template") if config.is_file() else None
    if isinstance(template, list):
        named = {str(t.get("name")): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{config} has chat templates {sorted(named)} and none named 'default'")
        template = named["default"]
    if not isinstance(template, str) or not template:
        raise FileNotFoundError(f"no chat template in {folder}: looked for {TEMPLATE_FILE} and the "
                                "\"chat_template\" field of tokenizer_config.json")
    return template


def template_variables(folder) -> dict:
    """bos_token, eos_token, ...: the named special tokens of the folder's tokenizer_config.json, which
    apply_chat_template hands to every template (Llama's reads bos_token; Qwen3's none)."""
    config = Path(folder) / "tokenizer_config.json"
    cfg = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
    names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
    values = {k: v.get("content") if isinstance(v, dict) else v for k, v in cfg.items() if k in names}
    return {k: v for k, v in values.items() if isinstance(v, str)}


# Rendering as transformers' apply_chat_template does it (transformers/utils/chat_template_utils.py, read in
# 5.x): a sandboxed jinja environment with trim_blocks, lstrip_blocks and loop controls, a tojson that writes
# plain JSON, raise_exception and strftime_now. {% generation %} ... {% endgeneration %} marks assistant text;
# here its body is rendered between two private-use characters that _render takes out again, keeping where
# they were: the spans are a by-product of the one rendering, with no state kept between renders.
_OPEN, _CLOSE = "\uf8f0", "\uf8f1"


class _GenerationTag(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
        return _OPEN + caller() + _CLOSE


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes <, >, & and ' for HTML; templates expect plain JSON (tool schemas, arguments)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


def _as_template_sees_it(message: dict) -> dict:
    """A message as apply_chat_template passes it: keys holding null left out (a null content or tool_calls,
    from an API or a parquet struct, is absent), and reasoning under an older name ("thinking", "reasoning")
    also given as reasoning_content, which Qwen3's template reads, and as thinking."""
    m = {k: v for k, v in message.items() if v is not None}
    reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
    return m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning}


def _render(template: str, messages: list, tools=None, add_generation_prompt=False, **extra):
    """(text, spans): the rendering, and the [start, end) character spans of its {% generation %} blocks."""
    raw = _compile(template).render(messages=[_as_template_sees_it(m) for m in messages], tools=tools,
                                    documents=None, add_generation_prompt=add_generation_prompt, **extra)
    if _OPEN not in raw and _CLOSE not in raw:
        return raw, []
    text, spans, opened, length = [], [], [], 0
    for piece in re.split(f"([{_OPEN}{_CLOSE}])", raw):
        if piece == _OPEN:
            opened.append(length)
        elif piece == _CLOSE:
            if not opened:
                raise RowError("the row holds U+F8F1, which marks the end of assistant text here")
            spans.append((opened.pop(), length))
        else:
            text.append(piece)
            length += len(piece)
    if opened:
        raise RowError("the row holds U+F8F0, which marks the start of assistant text here")
    return "".join(text), sorted(spans)


def render_chat(template: str, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = False, **extra) -> str:
    """The text of tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, ...) for this template;
    `extra` are the template's other variables (enable_thinking=False; the tokenizer's bos_token, eos_token,
    ... which apply_chat_template adds itself: see template_variables). Compiled once per template."""
    return _render(template, messages, tools, add_generation_prompt, **extra)[0]


def _assistant_spans(template: str, text: str, generated: list) -> list[tuple[int, int]]:
    """The [start, end) character spans of the assistant turns in a full rendering: the template's
    {% generation %} blocks if it has them; else, for ChatML (Qwen's <|im_start|>assistant\\n ... <|im_end|>),
    from the end of each assistant header through its <|im_end|>: the turn's content with any <think> block
    the rendering kept, its tool calls and the <|im_end|> the model must learn to stop on. The header, the
    newline after <|im_end|> and every other role are context."""
    if re.search(r"\{%-?\s*generation\s*-?%\}", template):
        return generated
    if "<|im_start|>" not in template:
        raise ValueError("the chat template marks no assistant text (no {% generation %} tags, no ChatML "
                         "<|im_start|>): set assistant_only_loss and completion_only_loss false to train on "
                         "every token")
    header, end, spans = "<|im_start|>assistant\n", "<|im_end|>", []
    at = text.find(header)
    while at >= 0:
        close = text.find(end, at + len(header))
        spans.append((at + len(header), len(text) if close < 0 else close + len(end)))
        at = text.find(header, spans[-1][1])
    return spans


def _tokens_in(offsets: np.ndarray, spans) -> np.ndarray:
    """[n] bool: the tokens whose characters overlap a span, apply_chat_template's rule for its assistant mask
    (a token that straddles a span's edge is in). offsets [n, 2] rise along the text."""
    mask = np.zeros(len(offsets), dtype=bool)
    for a, b in spans:
        mask[np.searchsorted(offsets[:, 1], a, side="right"):np.searchsorted(offsets[:, 0], b, side="left")] = True
    return mask


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise RowError("messages must be a non-empty list of messages")
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RowError(f"messages[{k}] is a {type(m).__name__}, not an object")
        role, content = m.get("role"), m.get("content")
        if role is None:
            raise RowError(f"messages[{k}] has no field 'role'")
        if role not in ROLES:
            raise RowError(f"unknown role {role!r} (roles: {', '.join(ROLES)})")
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            raise RowError(f"messages[{k}] ({role}) has no field 'content'")
        if content is not None and not isinstance(content, str):
            raise RowError(f"messages[{k}] ({role}): content is a {type(content).__name__}; only text (a string) "
                           "is supported")


def row_document(row: dict, tokenizer, *, chat_template: str | None = None, template_kwargs: dict | None = None,
                 assistant_only_loss: bool = True, completion_only_loss: bool = True,
                 text_column: str = "text") -> tuple[np.ndarray, np.ndarray]:
    """One row -> (ids [n] int64, trained [n] bool); a RowError for a row that cannot be trained on.

    text: the text's tokens and end-of-text, all trained. prompt/completion strings (TRL's convention): the
    concatenation, one encoding, and end-of-text; with completion_only_loss only the completion's tokens and
    the end-of-text are trained. messages, or prompt/completion message lists (the completion's messages
    appended to the prompt's): the whole conversation rendered once with `chat_template` (template_kwargs and
    the row's "chat_template_kwargs" as its variables, the row's "tools") and encoded once, as
    apply_chat_template(tokenize=True) does; assistant_only_loss trains the assistant turns (_assistant_spans),
    completion_only_loss on prompt/completion rows only those of the completion; with neither, every token.
    The mask comes from this one full rendering: Qwen3's template drops the reasoning of assistant turns before
    the last user message, so a turn rendered alone or as a prefix would not be the turn that is trained.
    """
    kind = row_format(row, text_column)
    eos = np.asarray([tokenizer.eos_id], dtype=np.int64)
    if kind == "text":
        if not isinstance(row[text_column], str):
            raise RowError(f"field {text_column!r} is a {type(row[text_column]).__name__}, not text")
        ids = np.concatenate([np.asarray(tokenizer.encode(row[text_column]), dtype=np.int64), eos])
        return ids, np.ones(len(ids), dtype=bool)
    prompt, completion = row.get("prompt"), row.get("completion")
    if kind == "prompt_completion" and isinstance(prompt, str) and isinstance(completion, str):
        ids, offsets = tokenizer.encode_offsets(prompt + completion)
        trained = _tokens_in(offsets, [(len(prompt), len(prompt) + len(completion))]) if completion_only_loss \
            else np.ones(len(ids), dtype=bool)
        ids, trained = np.concatenate([ids, eos]), np.append(trained, True)
    else:
        if kind == "prompt_completion" and not (isinstance(prompt, list) and isinstance(completion, list)):
            raise RowError("prompt and completion must both be strings or both be lists of messages")
        messages, first = (prompt + completion, len(prompt)) if kind == "prompt_completion" else (row["messages"], 0)
        _check_messages(messages)
        tools = row.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise RowError("field 'tools' must be a list of JSON schemas (objects)")
        if chat_template is None:
            raise ValueError("a conversation row needs a chat template (chat_template=load_chat_template(folder))")
        variables = {**(template_kwargs or {}), **(row.get("chat_template_kwargs") or {})}
        try:
            text, generated = _render(chat_template, messages, tools, False, **variables)
        except RowError:
            raise
        except Exception as err:  # the template is code from the model's folder, run on this row's data
            raise RowError(f"the chat template failed: {type(err).__name__}: {str(err).splitlines()[0]}") from None
        ids, offsets = tokenizer.encode_offsets(text)
        only_completion = kind == "prompt_completion" and completion_only_loss
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if assistant_only_loss or only_completion:
            spans = _assistant_spans(chat_template, text, generated)
            # ChatML turns are found in the text, so a user who writes "<|im_start|>assistant\n" would add one;
            # {% generation %} blocks may be several per turn, which matters only when turns are picked
            if len(spans) != len(turns) and (only_completion or not generated):
                raise RowError(f"the chat template rendered {len(spans)} assistant turns for {len(turns)} "
                               "assistant messages")
            if only_completion:
                spans = [s for s, k in zip(spans, turns) if k >= first]
            trained = _tokens_in(offsets, spans)
        else:
            trained = np.ones(len(ids), dtype=bool)
        if not any(k >= first for k in turns) and not trained[1:].any():
            raise RowError("no token to train on: no assistant message" + (" in the completion" if first else ""))
    if not trained[1:].any():  # the first token is never a target
        raise RowError("no token to train on")
    return ids, trained


def iter_documents(source: str, tokenizer, *, start_row: int = 0, chat_template: str | None = None,
                   template_kwargs: dict | None = None, assistant_only_loss: bool = True,
                   completion_only_loss: bool = True, seed: int = 0, repo: str = DEFAULT_PG19_REPO,
                   revision: str = "main", split: str = "train",
                   text_column: str = "text") -> Iterator[tuple[int, "Document | Skipped"]]:
    """(row_index, Document or Skipped) in a fixed order from row `start_row` on: what WindowLoader reads.

    source: as for iter_books ("synthetic[:N]", "pg19" for parquet on the hub from `repo`, a local .txt,
    .jsonl or .parquet file or a folder of them); each row is read as text, messages or prompt/completion by
    its keys (row_format) and made into a document by row_document with the options given here. A bad row
    (malformed JSON, a missing field, an unknown role, a chat template that raises, nothing to train on) is
    Skipped, with its file and line; a file that is not UTF-8, or a conversation row when there is no chat
    template, stops with a ValueError. chat_template None: the tokenizer folder's (load_chat_template), read
    at the first conversation; its named special tokens join template_kwargs, as in apply_chat_template.
    """
    if start_row < 0:
        raise ValueError(f"start_row must be >= 0, got {start_row}")
    options = dict(assistant_only_loss=assistant_only_loss, completion_only_loss=completion_only_loss,
                   text_column=text_column)
    if parse_synthetic(source) is not None:
        books = iter_books(source, seed=seed, start_book=start_row, split=split)
        return ((i, Document(*row_document({text_column: text}, tokenizer, **options), f"book {i}"))
                for i, text in books)
    if source == "pg19":
        fs = HfFileSystem()
        files = list_hub_parquet(fs, repo, revision, split)
    else:
        fs, files = LocalFileSystem(), _local_files(source, split)
    rows = read_rows(fs, files, start_row=start_row, columns=(text_column, *ROW_FIELDS))
    return _documents(rows, tokenizer, chat_template, template_kwargs, options)


def _documents(rows, tokenizer, template, template_kwargs, options):
    variables = None  # the template's variables, made at the first conversation
    for index, where, row in rows:
        if isinstance(row, Skipped):
            yield index, row
            continue
        try:
            kind = row_format(row, options["text_column"])
            chat = kind == "messages" or (kind == "prompt_completion" and not isinstance(row["prompt"], str))
            if variables is None and chat:
                if template is None and tokenizer.folder is None:
                    raise ValueError(f"{where} is a conversation, and the byte tokenizer has no chat template; "
                                     "pass chat_template")
                try:
                    template = template if template is not None else load_chat_template(tokenizer.folder)
                except FileNotFoundError as err:
                    raise ValueError(f"{where} is a conversation, but there is {err}") from None
                folder_vars = template_variables(tokenizer.folder) if tokenizer.folder is not None else {}
                variables = {**folder_vars, **(template_kwargs or {})}
            yield index, Document(*row_document(row, tokenizer, chat_template=template, template_kwargs=variables,
                                                **options), where)
        except RowError as err:
            yield index, Skipped(where, str(err))


def default_packing(source: str, *, split: str = "train", text_column: str = "text", repo: str = DEFAULT_PG19_REPO,
                    revision: str = "main") -> str:
    """'concat' for text, 'docs' for messages and prompt/completion rows: judged by the first file's parquet
    columns (its footer alone) or first JSON object; the synthetic corpus, PG-19 and .txt files are text."""
    if parse_synthetic(source) is not None or (source == "pg19" and repo == DEFAULT_PG19_REPO):
        return "concat"
    fs = HfFileSystem() if source == "pg19" else LocalFileSystem()
    files = list_hub_parquet(fs, repo, revision, split) if source == "pg19" else _local_files(source, split)
    if files[0].endswith(".parquet"):
        with fs.open(files[0], "rb") as f:
            row = dict.fromkeys(pq.ParquetFile(f).schema_arrow.names, "")
    else:
        rows = (r for _, _, r in read_rows(fs, files[:1], columns=(text_column,)) if not isinstance(r, Skipped))
        row = next(rows, {})
    try:
        return "concat" if row_format(row, text_column) == "text" else "docs"
    except RowError:
        return "concat"


# ---------------------------------------------------------------------------------------------
# Windows
# ---------------------------------------------------------------------------------------------

PACKINGS = ("concat", "docs")
SKIP_LINES = 100  # skipped rows written out per loader thread; later ones are only counted


@dataclasses.dataclass
class Window:
    """One sequence of T = seq_len (input, label) pairs, made of documents (packing "docs").

    A document of n tokens d gives n - 1 pairs: inputs d[:-1], labels d[1:] where trained, else -100. A
    query attends only within its document, and its RoPE position is its place in it (doc_positions).
    """
    inputs: torch.Tensor  # [T] int64
    labels: torch.Tensor  # [T] int64, -100 where not trained on
    doc_lens: list[int]   # the window's documents, in order; they sum to T
    pad: int              # padding pairs (input end-of-text, label -100) after the data's last document
    untrained: int        # pairs of real documents whose label is -100 (prompts, headers, other roles)

    @classmethod
    def from_concat(cls, w: torch.Tensor) -> "Window":
        """The same view of a concat window w [T + 1]: one document, every label kept."""
        return cls(w[:-1], w[1:], [w.numel() - 1], 0, 0)


def doc_positions(doc_lens: list[int]) -> torch.Tensor:
    """[T] int64: each pair's position inside its document, the RoPE position of a packed window."""
    lens = torch.as_tensor(doc_lens, dtype=torch.int64)                                        # [docs]
    starts = torch.cumsum(lens, 0) - lens                                                      # [docs]
    return torch.arange(int(lens.sum())) - torch.repeat_interleave(starts, lens)               # [T]


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")  # one write per line: lines of two threads do not run together


class WindowLoader:
    """Iterates over this rank's windows: with packing "concat", int64 tensors of shape [seq_len + 1]; with
    "docs", Windows of seq_len pairs.

    books(start) must yield (index, item) from row `start` on; it is called again on resume. An item is a
    text (a book: tokenized here, then end-of-text), a Document (iter_documents) or a Skipped row, which is
    counted and written out with `log` (default: stderr, on dp rank 0 only). A daemon thread tokenizes ahead
    into a queue of `prefetch` windows. In training one loader runs per data-parallel group, on the group's first
    rank (Batches); it tokenizes the whole stream, every group's windows, and copies only its own: tokenizing is
    seconds per 1M-token window against minutes of training.

    concat: documents are laid end to end into one stream cut into windows of seq_len + 1 tokens; every token
    is trained on, so a Document with tokens that are not (a conversation) stops with an error. No padding:
    the tail of finite data shorter than a round of windows is dropped.
    docs: the documents' pairs are laid end to end into windows of seq_len pairs, in order; a document longer
    than the space left is split at the window's end and its continuation starts the next window as a new
    document (it sees none of the earlier part, and no pair is lost). The last window of finite data is
    padded, and then whole windows of padding complete the round.

    A window is handed out only when its whole round of dp_size windows exists, so all ranks yield the same
    number of windows and stop together when finite data runs out (StopIteration). The state after a round is
    then the same on every rank: the stream position (row, token or pair offset in it) where the next round
    begins, that round's first global window, and the rows skipped so far. Saving it from rank 0 is enough,
    and a run may resume on a different number of ranks.
    """

    def __init__(self, books: Callable[[int], Iterator[tuple[int, "str | Document | Skipped"]]], tokenizer,
                 seq_len: int, dp_rank: int = 0, dp_size: int = 1, prefetch: int = 4, packing: str = "concat",
                 log: Callable[[str], None] | None = None):
        if seq_len < 1 or prefetch < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need seq_len >= 1, prefetch >= 1 and 0 <= dp_rank < dp_size; got seq_len={seq_len}, "
                             f"prefetch={prefetch}, dp_rank={dp_rank}, dp_size={dp_size}")
        if packing not in PACKINGS:
            raise ValueError(f"packing {packing!r}: choose one of {PACKINGS}")
        self.books, self.tokenizer, self.seq_len, self.packing = books, tokenizer, seq_len, packing
        self.dp_rank, self.dp_size, self.prefetch = dp_rank, dp_size, prefetch
        self.log = log if log is not None else _say if dp_rank == 0 else (lambda line: None)
        # what has been consumed, not what was prefetched
        self._state = {"book": 0, "offset": 0, "window": 0, "skipped": 0}
        self._thread = self._queue = self._stop = None
        self._final = None  # the StopIteration or error that ended the stream, raised again on every call

    def __iter__(self):
        return self

    def __next__(self) -> "torch.Tensor | Window":
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
        return value  # concat: [seq_len + 1] int64; docs: a Window

    @property
    def skipped(self) -> int:
        """Rows skipped from the start of the data through the last window handed out (kept across resume)."""
        return self._state["skipped"]

    def state_dict(self) -> dict:
        return dict(self._state, seq_len=self.seq_len, packing=self.packing)

    def load_state_dict(self, sd: dict) -> None:
        if sd["seq_len"] != self.seq_len:
            raise ValueError(f"the saved stream was cut into windows of {sd['seq_len']} + 1 tokens, not "
                             f"{self.seq_len} + 1; resume with the same seq_len")
        if sd.get("packing", "concat") != self.packing:  # states saved before packing existed were concat
            raise ValueError(f"the saved stream was packed with {sd.get('packing', 'concat')!r}, not "
                             f"{self.packing!r}; resume with the same packing")
        self.close()
        self._state = {"book": int(sd["book"]), "offset": int(sd["offset"]), "window": int(sd["window"]),
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
            windows = self._windows if self.packing == "concat" else self._packed_windows
            for window, state in windows(start):
                if not put(("window", window, state)):
                    return
            put(("end", StopIteration(), None))
        except BaseException as err:  # handed to the consumer, which raises it: never a hang, never a skip
            put(("error", err, None))

    def _documents(self, start, seen):
        """(row, ids [n] int64, trained [n] bool or None for all, where) of each document from start["book"]
        on. Skipped rows are written out and counted in seen["skipped"]; seen["rows"] counts every row read and
        seen["next"] is the row after the last one read."""
        printed = 0
        for book, item in self.books(start["book"]):
            if seen["rows"] == 0 and book != start["book"]:
                raise ValueError(f"books({start['book']}) began at book {book}; it must begin at the book asked for")
            seen["rows"], seen["next"] = seen["rows"] + 1, book + 1
            if isinstance(item, Skipped):
                seen["skipped"] += 1
                printed += 1
                if printed <= SKIP_LINES:
                    self.log(item.line() if printed < SKIP_LINES else
                             f"{item.line()} (later skipped rows are counted, not written)")
                continue
            if isinstance(item, str):
                yield book, np.asarray(self.tokenizer.encode(item) + [self.tokenizer.eos_id], dtype=np.int64), None, \
                    f"book {book}"
            else:
                yield book, item.ids, item.trained, item.where

    def _windows(self, start):
        """concat: (this rank's window, state after its round), one per round of dp_size windows, from `start`."""
        n, size, rank = self.seq_len + 1, self.dp_size, self.dp_rank
        base = window = start["window"]  # global index of the window being filled
        filled, buf, mine = 0, None, None
        offset, seen, tokens_seen = start["offset"], {"rows": 0, "skipped": start["skipped"]}, 0
        for book, tokens, trained, where in self._documents(start, seen):
            if trained is not None and not trained.all():
                raise ValueError(f"{where}: packing 'concat' trains on every token, and this row has tokens that are "
                                 "not trained on (a prompt, a chat's other roles): use packing 'docs'")
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
                    yield torch.from_numpy(mine), {"book": book, "offset": pos, "window": window + 1,
                                                   "skipped": seen["skipped"]}
                window, filled = window + 1, 0
        if window - base < size:
            raise ValueError(f"the data ran out before one window per rank: {seen['rows']} books and {tokens_seen} "
                             f"tokens from book {start['book']} on, but {size} rank(s) × (seq_len + 1) = {size * n} "
                             "tokens are needed")

    def _packed_windows(self, start):
        """docs: (this rank's Window, state after its round), one per round of dp_size windows, from `start`."""
        T, size, rank, eos = self.seq_len, self.dp_size, self.dp_rank, self.tokenizer.eos_id
        base = window = start["window"]  # global index of the window being filled
        filled, cur, mine = 0, None, None
        offset, seen = start["offset"], {"rows": 0, "skipped": start["skipped"]}

        def fill(length):  # this rank's window, [filled, filled + length) taken: inputs and labels to write
            nonlocal cur
            if filled == 0:  # unwritten pairs stay padding: input end-of-text, label -100
                cur = (np.full(T, eos, dtype=np.int64), np.full(T, -100, dtype=np.int64), [])
            cur[2].append(length)
            return cur[0][filled:filled + length], cur[1][filled:filled + length]

        def finished(pad):
            inputs, labels, doc_lens = cur
            untrained = int((labels == -100).sum()) - pad
            return Window(torch.from_numpy(inputs), torch.from_numpy(labels), doc_lens, pad, untrained)

        for book, ids, trained, _ in self._documents(start, seen):
            targets = ids[1:] if trained is None else np.where(trained[1:], ids[1:], -100)     # [n - 1]
            pos, offset = offset, 0  # the saved offset (in pairs) applies to the first document only
            while pos < len(targets):
                slot = (window - base) % size
                take = min(T - filled, len(targets) - pos)
                if slot == rank:  # other ranks' windows are only counted, never copied
                    inputs, labels = fill(take)
                    inputs[:], labels[:] = ids[pos:pos + take], targets[pos:pos + take]
                filled, pos = filled + take, pos + take
                if filled < T:
                    break  # this document is used up; the window carries on with the next
                if slot == rank:
                    mine = finished(0)
                if slot == size - 1:  # the round is complete: the next one starts at (book, pos)
                    yield mine, {"book": book, "offset": pos, "window": window + 1, "skipped": seen["skipped"]}
                window, filled = window + 1, 0
        if window == base and filled == 0:
            raise ValueError(f"the data ran out before one window: {seen['rows']} rows from row {start['book']} on "
                             f"({seen['skipped']} skipped in all) gave no token to train on")
        while filled > 0 or (window - base) % size != 0:  # pad the last window, then whole windows to the round
            slot, pad = (window - base) % size, T - filled
            if slot == rank:
                fill(pad)
                mine = finished(pad)
            if slot == size - 1:  # after the data: a resume from here finds nothing
                yield mine, {"book": seen["next"], "offset": 0, "window": window + 1, "skipped": seen["skipped"]}
            window, filled = window + 1, 0


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
    positions: torch.Tensor    # [1, T/cp] RoPE positions: in the sequence (concat) or in each document (docs)
    doc_lens: tuple | None     # the whole window's documents (docs); None: one causal sequence (concat)
    pad: int                   # padding pairs in the whole window


class Batches:
    """This rank's micro-batches, [Micro] * grad_accum per step.

    Only the first rank of each context-parallel group reads and tokenizes: make_loader() is called there alone
    (a WindowLoader over this data-parallel group's windows), and each window is broadcast to the rest of the
    group, which shards it (parallel.cp_shard: zigzag for one sequence; packed documents by their masked area
    unless balanced is False). An error on the reading rank stops every rank of the world together.
    packing "concat": a window is seq_len + 1 tokens of one stream, its labels the inputs shifted by one.
    packing "docs": a Window (inputs, labels, documents), sent as one [3, T + 1] tensor: inputs, labels, a 1 where
    a document starts, and the padding count in the last column."""

    def __init__(self, make_loader: Callable[[], "WindowLoader"], seq_len: int, grad_accum: int, packing: str,
                 cp_group, device, balanced: bool = True):
        self.seq_len, self.grad_accum, self.packing, self.balanced = seq_len, grad_accum, packing, balanced
        self.group, self.device = cp_group, device
        self.cp_rank, self.cp = dist.get_rank(cp_group), dist.get_world_size(cp_group)
        self.src = dist.get_global_rank(cp_group, 0)
        self.positions = cp_shard(torch.arange(seq_len, device=device), 0, self.cp_rank, self.cp)[None]
        self.loader, error = None, None
        if self.cp_rank == 0:
            try:
                self.loader = make_loader()
            except Exception as e:  # the tokenizers library raises plain Exceptions for a file it cannot parse
                error = f"error (rank {dist.get_rank()}): data: {type(e).__name__}: {str(e).splitlines()[0]}"
        all_ok(error, "setting up the data", device)

    def _window(self) -> torch.Tensor:
        T = self.seq_len
        w = torch.empty(T + 1 if self.packing == "concat" else (3, T + 1), dtype=torch.long)
        error, ended = None, False
        if self.loader is not None:
            try:
                got = next(self.loader)
                if self.packing == "concat":
                    w = got                                                   # [T + 1]
                else:
                    w.zero_()
                    w[0, :T], w[1, :T], w[2, T] = got.inputs, got.labels, got.pad
                    w[2, torch.tensor(got.doc_lens[:-1], dtype=torch.long).cumsum(0)] = 1  # documents 2.. start
                    w[2, 0] = 1
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

    def _micro(self, w) -> Micro:
        def shard(x, doc_lens=None):
            return cp_shard(x, 0, self.cp_rank, self.cp, doc_lens, self.balanced)[None]  # [1, T/cp]
        if self.packing == "concat":                  # [T + 1]: labels shifted on the whole sequence, then sharded
            return Micro(shard(w[:-1]), shard(w[1:]), self.positions, None, 0)
        T = self.seq_len
        starts = w[2, :T].nonzero().squeeze(1).tolist()
        doc_lens = tuple(b - a for a, b in zip(starts, starts[1:] + [T]))
        return Micro(shard(w[0, :T], doc_lens), shard(w[1, :T], doc_lens),
                     shard(doc_positions(doc_lens).to(w.device), doc_lens), doc_lens, int(w[2, T]))

    def next(self) -> list[Micro]:
        return [self._micro(self._window()) for _ in range(self.grad_accum)]

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


# ---------------------------------------------------------------------------------------------
# A look at what the loader makes of a source
# ---------------------------------------------------------------------------------------------

def marked(tokenizer, ids: np.ndarray, trained: np.ndarray) -> str:
    """The document's text with each run of trained tokens (targets) in [[ ]]."""
    cuts = np.flatnonzero(np.diff(trained.astype(np.int8))) + 1
    runs = zip(np.split(ids, cuts), np.split(trained, cuts))
    return "".join(f"[[{tokenizer.decode(r)}]]" if t[0] else tokenizer.decode(r) for r, t in runs if len(r))


def main(argv=None) -> None:
    import argparse
    parser = argparse.ArgumentParser(description="print what the loader makes of a source")
    parser.add_argument("source", nargs="?", default="synthetic")  # synthetic | pg19 | a local path
    parser.add_argument("--tokenizer", default="byte")  # byte | a tokenizer.json | a model folder
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--packing", choices=PACKINGS, default=None)  # default: by the data's first row
    parser.add_argument("--chat_template", default=None)  # a .jinja file; default: the tokenizer folder's
    parser.add_argument("--assistant_only_loss", choices=("true", "false"), default="true")
    parser.add_argument("--completion_only_loss", choices=("true", "false"), default="true")
    parser.add_argument("--text_column", default="text")
    parser.add_argument("--excerpt", type=int, default=1500, help="characters of the first document to show")
    args, t0 = parser.parse_args(argv), time.perf_counter()
    tok = load_tokenizer(args.tokenizer)
    packing = args.packing or default_packing(args.source, text_column=args.text_column)
    template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
    docs = functools.partial(iter_documents, args.source, tok, chat_template=template, text_column=args.text_column,
                             assistant_only_loss=args.assistant_only_loss == "true",
                             completion_only_loss=args.completion_only_loss == "true")
    first = next((d for _, d in docs(start_row=0) if isinstance(d, Document)), None)
    if first is not None and first.trained.all():
        print(f"{first.where}, {len(first.ids)} tokens, every one trained\n")
    elif first is not None:
        text = marked(tok, first.ids, first.trained)
        print(f"{first.where}, {len(first.ids)} tokens, {int(first.trained[1:].sum())} trained ([[ ]]):\n"
              f"{text[:args.excerpt]}{' ...' if len(text) > args.excerpt else ''}\n")
    loader = WindowLoader(lambda row: docs(start_row=row), tok, args.seq_len, packing=packing)
    for k, w in zip(range(args.windows), loader):
        if packing == "concat":
            print(f"window {k}: {w.numel()} tokens, {int((w == tok.eos_id).sum())} document ends, "
                  f"{time.perf_counter() - t0:.2f} s, state {loader.state_dict()}")
        else:
            T = args.seq_len
            print(f"window {k}: {len(w.doc_lens)} documents, padding {w.pad / T:.1%}, not trained "
                  f"{w.untrained / T:.1%}, trained {(T - w.pad - w.untrained) / T:.1%}, "
                  f"{time.perf_counter() - t0:.2f} s, state {loader.state_dict()}")
    print(f"{loader.skipped} rows skipped so far")
    loader.close()


if __name__ == "__main__":
    try:
        main()
    except (OSError, ValueError, RowError) as e:  # bad input: one line, no traceback
        sys.exit(f"error: {type(e).__name__}: {str(e).splitlines()[0]}")
