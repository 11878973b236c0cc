"""data.py against streams built independently here: exact windows, resume, data parallelism,
sources, errors.

    python -m pytest tests/test_data.py -q
"""
import itertools
import json
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402

# Seven books of awkward, varied lengths: empty, tiny, non-ASCII, and several longer than a window.
BOOKS = [
    "It was the best of times. " * 9,
    "é",
    "Call me Ishmael. Some years ago, never mind how long precisely, " * 13,
    "",
    "Whan that Aprille with his shoures soote / The droghte of March hath perced to the roote\n" * 5,
    "a",
    "Stately, plump Buck Mulligan came from the stairhead, bearing a bowl of lather. " * 11,
]


def oracle_stream(books, encode, eos):
    """Each book's tokens then eos, concatenated: the stream every window must be a slice of."""
    out = []
    for text in books:
        out += list(encode(text)) + [eos]
    return torch.tensor(out, dtype=torch.int64)


def take(loader, k):
    return [next(loader) for _ in range(k)]


def drain(loader):
    out = list(loader)
    loader.close()
    return out


def next_within(loader, seconds=10.0):
    """next(loader), failing the test instead of hanging if no answer comes."""
    box = {}

    def run():
        try:
            box["value"] = next(loader)
        except BaseException as err:
            box["error"] = err

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the loader hung"
    if "error" in box:
        raise box["error"]
    return box["value"]


def write_parquet(path, books, row_group_size=2, column="text"):
    pq.write_table(pa.table({column: books, "title": [f"book {i}" for i in range(len(books))]}), path,
                   row_group_size=row_group_size)
    return path


def write_jsonl(path, books, column="text"):
    path.write_text("".join(json.dumps({column: b, "id": i}) + "\n" for i, b in enumerate(books)))
    return path


def docs_of(source, tokenizer, **kw):
    """What the loader reads from row `start` on: the source's books, tokenized."""
    return lambda start: data.tokenized(data.iter_books(str(source), start_book=start, **kw), tokenizer)


@pytest.fixture
def pg19(tmp_path):
    """A small stand-in for a PG-19 parquet file: 7 books in 4 row groups."""
    path = write_parquet(tmp_path / "train-00000-of-00001.parquet", BOOKS)
    assert pq.ParquetFile(path).num_row_groups == 4
    return path


def bpe_tokenizer(tmp_path, special):
    """A small byte-level BPE trained here, saved as folder/tokenizer.json like a model folder holds it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(BOOKS, trainer)
    tok.add_special_tokens(special)
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder, tok


# ---------------------------------------------------------------------------------------------
# Exact windows
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seq_len", [1, 36, 97, 300])
def test_windows_are_the_stream_cut_exactly(pg19, seq_len):
    tok = data.ByteTokenizer()
    windows = drain(data.WindowLoader(docs_of(pg19, tok), seq_len, prefetch=2))
    stream = oracle_stream(BOOKS, lambda t: t.encode("utf-8"), 256)
    n = seq_len + 1
    assert len(windows) == len(stream) // n >= 3
    for w in windows:
        assert w.dtype == torch.int64 and w.shape == (n,)
    torch.testing.assert_close(torch.cat(windows), stream[: len(windows) * n], rtol=0, atol=0)
    # Books are separated by eos: it sits exactly where each book's bytes end, counted book by book.
    ends = list(itertools.accumulate(len(b.encode("utf-8")) + 1 for b in BOOKS))
    eos_at = (torch.cat(windows) == 256).nonzero().flatten().tolist()
    assert eos_at == [e - 1 for e in ends if e <= len(windows) * n]


def test_windows_with_a_tokenizer_json(tmp_path, pg19):
    folder, tok = bpe_tokenizer(tmp_path, ["<|endoftext|>"])
    eos = tok.token_to_id("<|endoftext|>")
    for spec in (folder, folder / "tokenizer.json"):
        loaded = data.load_tokenizer(str(spec))
        assert loaded.eos_id == eos == tok.get_vocab_size() - 1 and loaded.vocab_size == tok.get_vocab_size()
        windows = drain(data.WindowLoader(docs_of(pg19, loaded), 53))
        stream = oracle_stream(BOOKS, lambda t: tok.encode(t, add_special_tokens=False).ids, eos)
        assert len(windows) == len(stream) // 54 >= 3
        assert torch.equal(torch.cat(windows), stream[: len(windows) * 54])


def test_load_tokenizer_eos_choice_and_errors(tmp_path):
    byte = data.load_tokenizer("byte")
    assert byte.encode("aé") == [97, 195, 169] and byte.eos_id == 256 and byte.vocab_size == 257
    folder, tok = bpe_tokenizer(tmp_path, ["<|im_end|>", "</s>"])  # "</s>" comes before "<|im_end|>" in the order
    assert data.load_tokenizer(str(folder)).eos_id == tok.token_to_id("</s>")
    other = tmp_path / "other"
    other.mkdir()
    folder, _ = bpe_tokenizer(other, ["<pad>"])
    with pytest.raises(ValueError, match="end-of-text"):
        data.load_tokenizer(str(folder))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        data.load_tokenizer(str(tmp_path / "nowhere"))
    (tmp_path / "no_tokenizer").mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        data.load_tokenizer(str(tmp_path / "no_tokenizer"))


# ---------------------------------------------------------------------------------------------
# Determinism, resume, data parallelism
# ---------------------------------------------------------------------------------------------

def test_synthetic_is_deterministic_per_seed():
    tok = data.ByteTokenizer()
    a = take(data.WindowLoader(docs_of("synthetic", tok, seed=3), 500), 3)
    b = take(data.WindowLoader(docs_of("synthetic", tok, seed=3), 500), 3)
    c = take(data.WindowLoader(docs_of("synthetic", tok, seed=4), 500), 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not any(torch.equal(x, y) for x, y in zip(a, c))
    # Book i is a pure function of (seed, i): starting at book 5 gives the sixth book.
    assert next(data.iter_books("synthetic", seed=3, start_book=5)) == (5, data.synthetic_book(3, 5))
    assert list(itertools.islice(data.iter_books("synthetic", seed=3), 6))[5] == (5, data.synthetic_book(3, 5))


def test_synthetic_repeats_an_early_passage_much_later():
    for i in range(5):
        text = data.synthetic_book(0, i)
        assert 2000 < len(text) < 12000
        # Some 100-character passage from the first quarter recurs in the second half of the book.
        quarter, half = len(text) // 4, len(text) // 2
        assert any(text.find(text[s:s + 100], half) >= 0 for s in range(quarter)), f"no repeat in book {i}"
        # ...whereas unrelated books share no such passage (the repeat is structure, not chance).
        other = data.synthetic_book(0, i + 100)
        assert not any(other.find(text[s:s + 100]) >= 0 for s in range(0, quarter, 10))


def test_synthetic_words_sets_the_recall_distance():
    """synthetic:N: books of N/2..3N/2 words whose passage recurs within the book; the default is N = 800, the
    same books as before the parameter existed."""
    assert data.synthetic_book(0, 7) == data.synthetic_book(0, 7, 800)
    assert next(data.iter_books("synthetic:800", seed=2, start_book=3))[1] == data.synthetic_book(2, 3)
    short = [t for _, t in itertools.islice(data.iter_books("synthetic:50", seed=0), 20)]
    assert all(500 < len(t) < 1800 for t in short), sorted(map(len, short))
    for t in short:  # a 60-character piece of the passage recurs (at most a book's length later)
        assert any(t.find(t[s:s + 60], s + 60) >= 0 for s in range(len(t) // 4)), t
    with pytest.raises(ValueError, match="synthetic:N"):
        data.iter_books("synthetic:many")
    with pytest.raises(ValueError, match="words >= 16"):
        data.iter_books("synthetic:4")


def test_synthetic_validation_split_is_held_out():
    """Held-out synthetic books for evaluation: the same vocabulary (seed), books no training stream reaches."""
    train = [t for _, t in itertools.islice(data.iter_books("synthetic:100", seed=0, split="train"), 50)]
    val = list(itertools.islice(data.iter_books("synthetic:100", seed=0, split="validation", start_book=2), 3))
    assert [i for i, _ in val] == [2, 3, 4]  # indices count within the split, as resume expects
    assert val[0][1] == data.synthetic_book(0, 10**9 + 2, 100)
    assert not any(v == t for _, v in val for t in train)
    vocab = set(" ".join(train).split())
    assert set(val[0][1].split()) <= vocab  # the same language
    with pytest.raises(ValueError, match="splits"):
        data.iter_books("synthetic", split="dev")


@pytest.mark.parametrize("before, dp_size", [(1, 1), (3, 1), (30, 1), (2, 2), (9, 3)])
def test_resume_continues_with_exactly_the_same_windows(pg19, before, dp_size):
    tok, seq_len = data.ByteTokenizer(), 40
    for rank in range(dp_size):
        first = data.WindowLoader(docs_of(pg19, tok), seq_len, rank, dp_size, prefetch=8)
        take(first, before)
        time.sleep(0.05)  # let the thread run ahead: the state must still describe what was consumed
        state = json.loads(json.dumps(first.state_dict()))
        expected = take(first, 2)
        first.close()
        fresh = data.WindowLoader(docs_of(pg19, tok), seq_len, rank, dp_size, prefetch=1)
        fresh.load_state_dict(state)
        got = take(fresh, 2)
        fresh.close()
        assert all(torch.equal(x, y) for x, y in zip(expected, got))
    if (before, dp_size) == (1, 1):
        assert state["row"] == 0 and state["offset"] == 41  # resumes inside a book
    if (before, dp_size) == (30, 1):
        assert state["row"] == 4 and 0 < state["offset"]  # after crossing several books, inside one


def test_resume_on_synthetic_and_loading_into_a_running_loader():
    tok = data.ByteTokenizer()
    loader = data.WindowLoader(docs_of("synthetic", tok, seed=1), 1000)
    take(loader, 4)
    state = loader.state_dict()
    expected = take(loader, 3)
    loader.load_state_dict(state)  # rewinds a loader whose thread is running
    assert all(torch.equal(x, y) for x, y in zip(expected, take(loader, 3)))
    with pytest.raises(ValueError, match="same seq_len"):
        data.WindowLoader(docs_of("synthetic", tok), 999).load_state_dict(state)
    loader.close()


def test_data_parallel_ranks_take_interleaved_windows(pg19):
    tok = data.ByteTokenizer()
    single = drain(data.WindowLoader(docs_of(pg19, tok), 30))
    for size in (2, 3):
        loaders = [data.WindowLoader(docs_of(pg19, tok), 30, rank, size) for rank in range(size)]
        per_rank = [drain(l) for l in loaders]
        rounds = len(single) // size
        for rank, windows in enumerate(per_rank):
            assert len(windows) == rounds  # every rank stops after the same step, even on a ragged end
            assert all(torch.equal(w, single[rank + size * k]) for k, w in enumerate(windows))
    # After the same number of steps every rank holds the same state, that of a 1-rank run after 2x the windows.
    states = []
    for rank in range(2):
        loader = data.WindowLoader(docs_of(pg19, tok), 30, rank, 2)
        take(loader, 3)
        states.append(loader.state_dict())
        loader.close()
    one = data.WindowLoader(docs_of(pg19, tok), 30)
    take(one, 6)
    assert states[0] == states[1] == one.state_dict()
    one.close()
    # A run may resume on another number of ranks: after 3 windows of a 1-rank run, two ranks take 3, 5 / 4, 6.
    one = data.WindowLoader(docs_of(pg19, tok), 30)
    take(one, 3)
    state = one.state_dict()
    one.close()
    for rank in range(2):
        loader = data.WindowLoader(docs_of(pg19, tok), 30, rank, 2)
        loader.load_state_dict(state)
        assert all(torch.equal(w, single[3 + rank + 2 * k]) for k, w in enumerate(take(loader, 2)))
        loader.close()


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------

def test_sources_agree_and_start_book_skips(tmp_path, pg19):
    write_jsonl(tmp_path / "books.jsonl", BOOKS)
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, text in enumerate(BOOKS):
        (folder / f"book_{i:02d}.txt").write_text(text, encoding="utf-8")
    (folder / "notes.md").write_text("not a book")
    mixed = tmp_path / "mixed"  # a PG-19-like data/ folder: only the train split is read, files in name order
    mixed.mkdir()
    write_parquet(mixed / "train-00000-of-00002.parquet", BOOKS[:3], row_group_size=1)
    write_jsonl(mixed / "train-00001-of-00002.jsonl", BOOKS[3:])
    write_parquet(mixed / "test-00000-of-00001.parquet", ["a test book"])
    write_jsonl(mixed / "validation-00000-of-00001.jsonl", ["a validation book"])
    for source in (pg19, tmp_path / "books.jsonl", folder, mixed):
        assert [b for _, b in data.iter_books(str(source))] == BOOKS, source
        for start in (0, 1, 3, 6, 7, 9):
            assert list(data.iter_books(str(source), start_book=start)) == list(enumerate(BOOKS))[start:], source
    assert list(data.iter_books(str(folder / "book_02.txt"))) == [(0, BOOKS[2])]
    assert [b for _, b in data.iter_books(str(mixed), split="test")] == ["a test book"]


def test_parquet_row_groups_before_start_book_are_not_read(pg19):
    class CountingFS(LocalFileSystem):
        opens = 0

        def open(self, path, mode="rb", **kw):
            CountingFS.opens += 1
            return super().open(path, mode, **kw)

    books = list(data.read_books(CountingFS(), [str(pg19)], start_book=5))
    assert books == [(5, BOOKS[5]), (6, BOOKS[6])]
    assert CountingFS.opens == 1 + 2  # the footer, then row groups 2 (books 4, 5) and 3 (book 6) only


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def test_bad_sources_fail_clearly(tmp_path, pg19):
    with pytest.raises(FileNotFoundError, match="nothing_here.*synthetic"):
        data.iter_books(str(tmp_path / "nothing_here"))
    (tmp_path / "book.csv").write_text("a,b")
    with pytest.raises(ValueError, match=r"unsupported file type '\.csv'"):
        data.iter_books(str(tmp_path / "book.csv"))
    with pytest.raises(ValueError, match=r"no column 'body'.*\['text', 'title'\]"):
        list(data.iter_books(str(pg19), text_column="body"))
    with pytest.raises(ValueError, match=r"no field 'body'.*\['id', 'text'\]"):
        list(data.iter_books(str(write_jsonl(tmp_path / "b.jsonl", BOOKS)), text_column="body"))
    with pytest.raises(ValueError, match="seq_len"):
        data.WindowLoader(docs_of(pg19, data.ByteTokenizer()), 0)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="ran out before one window.*0 books"):
        next_within(data.WindowLoader(docs_of(tmp_path / "empty.jsonl", data.ByteTokenizer()), 8))
    # Too little data for one window per rank is the same clear error, not a hang.
    with pytest.raises(ValueError, match="ran out before one window"):
        next_within(data.WindowLoader(docs_of(pg19, data.ByteTokenizer()), 10_000))
    # A missing path given to the loader surfaces from its thread with its own type and message.
    with pytest.raises(FileNotFoundError, match="nothing_here"):
        next_within(data.WindowLoader(docs_of(tmp_path / "nothing_here", data.ByteTokenizer()), 8))


def test_exception_in_the_thread_reaches_the_consumer():
    def books(start):
        yield 0, "x" * 30
        yield 1, "y" * 30
        raise OSError("disk on fire after 2 books")

    loader = data.WindowLoader(lambda start: data.tokenized(books(start), data.ByteTokenizer()), 20, prefetch=1)
    # 62 tokens arrive before the failure: two whole windows of 21, then the error instead of a third.
    assert torch.equal(torch.cat([next_within(loader), next_within(loader)]),
                       oracle_stream(["x" * 30, "y" * 30], lambda t: t.encode(), 256)[:42])
    with pytest.raises(OSError, match="disk on fire"):
        next_within(loader)
    with pytest.raises(OSError, match="disk on fire"):  # and it stays failed rather than skipping ahead
        next_within(loader)
    loader.close()


def test_close_stops_the_thread_promptly():
    loader = data.WindowLoader(docs_of("synthetic", data.ByteTokenizer()), 64, prefetch=2)
    next(loader)
    thread = loader._thread
    time.sleep(0.05)  # the queue is full: the thread is waiting to put
    t0 = time.perf_counter()
    loader.close()
    thread.join(2.0)
    assert not thread.is_alive() and time.perf_counter() - t0 < 2.0


class FlakyFS(LocalFileSystem):
    """A local file system whose open() calls numbered in `fail` raise, like a hub connection that drops."""

    def __init__(self, fail):
        super().__init__()
        self.fail, self.calls = set(fail), 0

    def open(self, path, mode="rb", **kw):
        self.calls += 1
        if self.calls in self.fail:
            raise OSError(f"connection reset (call {self.calls})")
        return super().open(path, mode, **kw)

    def glob(self, pattern, **kw):
        self.calls += 1
        if self.calls in self.fail:
            raise TimeoutError("read timed out")
        return [f"{pattern.split('/**')[0]}/{name}" for name in (
            "data/validation-00000-of-00001.parquet", "data/train-00001-of-00002.parquet",
            "data/train-00000-of-00002.parquet", "data/test-00000-of-00001.parquet",
            "default/partial-train/0000.parquet", "default/train/0000.parquet")]


def test_flaky_reads_are_retried_with_backoff(pg19):
    slept = []
    fs = FlakyFS(fail={1, 3, 4})  # the footer once, then the first row group twice
    books = list(data.read_books(fs, [str(pg19)], sleep=slept.append))
    assert books == list(enumerate(BOOKS))
    assert slept == [1, 1, 2]


def test_a_hub_that_stays_down_fails_clearly(pg19):
    slept = []
    fs = FlakyFS(fail=range(2, 100))  # the footer is read, every row group read fails
    with pytest.raises(RuntimeError, match=r"row group 0 of .*train-00000.*5 times.*hub could not be reached"
                                           r".*HF_TOKEN.*--data") as info:
        list(data.read_books(fs, [str(pg19)], sleep=slept.append))
    assert isinstance(info.value.__cause__, OSError)
    assert slept == [1, 2, 4, 8]
    # Mistakes are not retried: a missing column fails at once.
    slept.clear()
    with pytest.raises(ValueError, match="no column"):
        list(data.read_books(FlakyFS(fail=()), [str(pg19)], text_column="body", sleep=slept.append))
    assert slept == []


def test_hub_listing_filters_the_split_and_retries():
    slept = []
    files = data.list_hub_parquet(FlakyFS(fail={1}), "someone/pg19", "refs/convert/parquet", "train", slept.append)
    root = "datasets/someone/pg19@refs%2Fconvert%2Fparquet"
    assert files == [f"{root}/data/train-00000-of-00002.parquet", f"{root}/data/train-00001-of-00002.parquet",
                     f"{root}/default/train/0000.parquet"]
    assert slept == [1]
    with pytest.raises(RuntimeError, match="listing the parquet files of datasets/someone/pg19@main.*HF_TOKEN"):
        data.list_hub_parquet(FlakyFS(fail=range(1, 10)), "someone/pg19", sleep=slept.append)
    with pytest.raises(ValueError, match="no parquet files of split 'dev'"):
        data.list_hub_parquet(FlakyFS(fail=()), "someone/pg19", split="dev")
    assert data.DEFAULT_PG19_REPO == "emozilla/pg19"


def test_pg19_source_streams_through_the_hub_file_system(pg19, monkeypatch):
    class FakeHub(LocalFileSystem):  # the hub's layout, served from the local stand-in file
        def glob(self, pattern, **kw):
            assert pattern == "datasets/emozilla/pg19@main/**/*.parquet"
            return [str(pg19), str(pg19).replace("train-", "test-")]

    monkeypatch.setattr(data, "HfFileSystem", FakeHub)
    assert list(data.iter_books("pg19", start_book=2)) == list(enumerate(BOOKS))[2:]
