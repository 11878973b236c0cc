"""Packing "docs": documents laid end to end into windows of seq_len (input, label) pairs, each document attending
only to itself, with positions that restart at each document.

A document of n tokens gives n - 1 pairs. Documents fill each window in order; one longer than the space left
is split at the window's end and its continuation starts the next window as a new document (it sees none of the
earlier part, and no pair is lost). The last window of finite data is padded, and then whole windows of padding
complete the round of data-parallel ranks. A window travels to the ranks of its context-parallel group as one
tensor and is sharded by a layout of its documents (parallel.cp_shard), balanced by their masked attention area.

    python -m million.chat chats.jsonl --tokenizer /path/to/Qwen3-8B --seq_len 32768   # rows packed as documents
    python -m pytest tests/test_rows.py -q -k packed
"""
import dataclasses
from typing import Callable

import numpy as np
import torch

import data

PACKINGS = ("concat", "docs")  # --packing: data.WindowLoader's one stream, or this file's documents


@dataclasses.dataclass
class Window:
    """One sequence of T = seq_len (input, label) pairs, made of documents.

    A document of n tokens d gives n - 1 pairs: inputs d[:-1], labels d[1:] where trained, else -100. A
    query attends only within its document, and its RoPE position is its place in it (doc_positions).
    """
    inputs: torch.Tensor  # [T] int64
    labels: torch.Tensor  # [T] int64, -100 where not trained on
    doc_lens: list[int]   # the window's documents in order, the padding (if any) last as one more; they sum to T
    pad: int              # padding pairs (input end-of-text, label -100) after the data's last document
    untrained: int        # pairs of real documents whose label is -100 (prompts, headers, other roles)

    @property
    def documents(self) -> int:
        """Documents of the data in this window (pieces of split ones included), the padding not counted."""
        return len(self.doc_lens) - (self.pad > 0)

    def summary(self) -> str:
        T = len(self.inputs)
        return (f"{self.documents} documents, padding {self.pad / T:.1%}, not trained {self.untrained / T:.1%}, "
                f"trained {(T - self.pad - self.untrained) / T:.1%}")


def doc_positions(doc_lens: list[int]) -> torch.Tensor:
    """[T] int64: each pair's position inside its document, the RoPE position of a packed window."""
    lens = torch.as_tensor(doc_lens, dtype=torch.int64)                                        # [docs]
    starts = torch.cumsum(lens, 0) - lens                                                      # [docs]
    return torch.arange(int(lens.sum())) - torch.repeat_interleave(starts, lens)               # [T]


class PackedLoader(data.WindowLoader):
    """data.WindowLoader with windows of documents: iterates over this rank's Windows of seq_len pairs, padded with
    pad_id (inputs) and -100 (labels). The rounds, the state and resume are the base class's; the state's offset
    counts pairs, and its field "packing" says "docs" (data.WindowLoader refuses such a state, and this loader
    one without it)."""

    def __init__(self, documents, seq_len: int, pad_id: int, dp_rank: int = 0, dp_size: int = 1, prefetch: int = 4,
                 log: Callable[[str], None] | None = None):
        super().__init__(documents, seq_len, dp_rank, dp_size, prefetch, log)
        self.pad_id = pad_id

    def state_dict(self) -> dict:
        return dict(super().state_dict(), packing="docs")  # a stream resumes only with the packing that cut it

    def load_state_dict(self, sd: dict) -> None:
        saved = sd.get("packing", "concat")  # a state without the field was saved by data.WindowLoader
        if saved != "docs":
            raise ValueError(f"the saved stream was packed with {saved!r}, not 'docs'; resume with the same packing")
        super().load_state_dict({k: v for k, v in sd.items() if k != "packing"})

    def windows(self, start):
        """(this rank's Window, state after its round), one per round of dp_size windows, from `start`."""
        T, size, rank, pad_id = self.seq_len, self.dp_size, self.dp_rank, self.pad_id
        base = window = start["window"]  # global index of the window being filled
        filled, cur, mine = 0, None, None
        offset, seen = start["offset"], {"rows": 0, "skipped": start["skipped"]}

        def fill(length):  # this rank's window, [filled, filled + length) taken: inputs and labels to write
            nonlocal cur
            if filled == 0:  # unwritten pairs stay padding: input pad_id, label -100
                cur = (np.full(T, pad_id, dtype=np.int64), np.full(T, -100, dtype=np.int64), [])
            cur[2].append(length)
            return cur[0][filled:filled + length], cur[1][filled:filled + length]

        def finished(pad):
            inputs, labels, doc_lens = cur
            untrained = int((labels == -100).sum()) - pad
            return Window(torch.from_numpy(inputs), torch.from_numpy(labels), doc_lens, pad, untrained)

        for row, doc in self.read(start, seen):
            ids = doc.ids
            targets = np.where(doc.trained[1:], ids[1:], -100)                                # [n - 1]
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
                if slot == size - 1:  # the round is complete: the next one starts at (row, pos)
                    yield mine, {"row": row, "offset": pos, "window": window + 1, "skipped": seen["skipped"]}
                window, filled = window + 1, 0
        if window == base and filled == 0:
            raise ValueError(f"the data ran out before one window: {seen['rows']} rows from row {start['row']} on "
                             f"({seen['skipped']} skipped in all) gave no token to train on")
        while filled > 0 or (window - base) % size != 0:  # pad the last window, then whole windows to the round
            slot, pad = (window - base) % size, T - filled
            if slot == rank:
                fill(pad)
                mine = finished(pad)
            if slot == size - 1:  # after the data: a resume from here finds nothing
                yield mine, {"row": seen["next"], "offset": 0, "window": window + 1, "skipped": seen["skipped"]}
            window, filled = window + 1, 0


@dataclasses.dataclass
class PackedMicro(data.Micro):
    """data.Micro of a Window: positions are inside each document (doc_positions)."""
    doc_lens: tuple            # the whole window's documents, the padding (if any) last; they sum to T
    pad: int                   # padding pairs in the whole window


class PackedBatches(data.Batches):
    """data.Batches of Windows, each step a list of PackedMicro. A Window is sent as one [3, T + 1] tensor: inputs,
    labels, a 1 where a document starts, and the padding count in the last column. Each rank shards it by
    layout_of(doc_lens), the chunks each rank holds (parallel.cp_shard's layout; layout_of None: zigzag), and
    takes RoPE positions inside each document."""

    def __init__(self, make_loader: Callable[[], PackedLoader], seq_len: int, grad_accum: int, cp_group, device,
                 layout_of: Callable[[tuple], tuple] | None = None):
        super().__init__(make_loader, seq_len, grad_accum, cp_group, device)
        self.layout_of = layout_of

    def empty(self) -> torch.Tensor:
        return torch.empty(3, self.seq_len + 1, dtype=torch.long)

    def encode(self, window: Window) -> torch.Tensor:
        T, w = self.seq_len, self.empty().zero_()
        w[0, :T], w[1, :T], w[2, T] = window.inputs, window.labels, window.pad
        w[2, torch.tensor(window.doc_lens[:-1], dtype=torch.long).cumsum(0)] = 1  # documents 2.. start
        w[2, 0] = 1
        return w                                                              # [3, T + 1]

    def micro(self, w) -> PackedMicro:
        T = self.seq_len
        starts = w[2, :T].nonzero().squeeze(1).tolist()
        doc_lens = tuple(b - a for a, b in zip(starts, starts[1:] + [T]))
        layout = self.layout_of(doc_lens) if self.layout_of is not None else None
        return PackedMicro(self.shard(w[0, :T], layout), self.shard(w[1, :T], layout),
                           self.shard(doc_positions(doc_lens).to(w.device), layout), doc_lens, int(w[2, T]))
