"""Where books and rows come from: local .txt/.jsonl/.parquet files, or parquet files streamed from the Hugging Face
hub, read row by row in a fixed order, with retries for the network and one clear line for a bad row or file.

A library under data.py: it knows files and rows, not tokens or windows.

    python -m pytest tests/test_data.py -q      # sources, retries and bad files, with the loader
"""
import dataclasses
import json
import time
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import quote

import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem
from huggingface_hub import HfFileSystem

# A parquet copy of PG-19 (28,602 train books, 11 GB): data/{train,validation,test}-000NN-of-000MM-*.parquet with
# columns short_book_title, publication_date, url, text. The original deepmind/pg19 is a loading script; its
# parquet conversion (revision refs/convert/parquet, default/train/*.parquet) also works here.
DEFAULT_PG19_REPO = "emozilla/pg19"
SUFFIXES = (".txt", ".jsonl", ".parquet")
SPLITS = ("train", "validation", "test")


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


def files_of(source: str, split: str = "train", repo: str = DEFAULT_PG19_REPO,
             revision: str = "main") -> tuple[object, list[str]]:
    """(fs, paths) of a source: "pg19" is `repo`'s parquet files on the hub, anything else a local file or folder."""
    if source == "pg19":
        fs = HfFileSystem()
        return fs, list_hub_parquet(fs, repo, revision, split)
    return LocalFileSystem(), _local_files(source, split)
