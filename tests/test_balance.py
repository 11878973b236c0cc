"""The chunk layout of packed documents over the ranks (documents.balanced_layout) and the cost model's masked area
(documents.document_area): pure functions of the document lengths, on CPU.

    python -m pytest tests/test_balance.py -q
"""
import random

import pytest
import torch

from million import documents
from million import hf
import parallel
from million import plan
from million.documents import balanced_layout, chunk_areas, cp_layout, document_area, parse_doc_lens
from parallel import cp_shard, cp_unshard


def long_tailed(total, seed, median=4096, sigma=1.5):
    """Document lengths drawn from a log-normal (most short, a few as long as the window), cut to fill `total`."""
    rng, lens = random.Random(seed), []
    while sum(lens) < total:
        lens.append(min(max(1, int(rng.lognormvariate(0, sigma) * median)), total - sum(lens)))
    return tuple(lens)


def loads(doc_lens, layout):
    areas = chunk_areas(doc_lens, sum(map(len, layout)))
    return [sum(areas[j] for j in held) for held in layout]


def excess(doc_lens, layout):
    """The busiest rank's area over the mean, minus 1."""
    got = loads(doc_lens, layout)
    return max(got) * len(got) / sum(got) - 1


def test_chunk_areas_count_the_document_mask():
    """Each chunk's area is the number of (query in the chunk, key) pairs of the document mask, for random windows."""
    gen = random.Random(0)
    for _ in range(50):
        n = gen.choice([4, 8, 12, 24])
        lens = []
        while sum(lens) < 48:
            lens.append(min(gen.randint(1, 20), 48 - sum(lens)))
        keep, start = torch.zeros(48, 48, dtype=torch.int64), 0
        for length in lens:
            keep[start:start + length, start:start + length] = 1
            start += length
        want = keep.tril().sum(1).view(n, -1).sum(1).tolist()
        assert chunk_areas(tuple(lens), n) == want, lens


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_layout_is_a_partition_in_equal_counts(world):
    for seed in range(10):
        doc_lens = long_tailed(2 * world * 8192, seed)
        layout = balanced_layout(doc_lens, world)
        per_rank = len(layout[0])
        assert per_rank in documents.BALANCE_CHUNKS and all(len(h) == per_rank for h in layout)
        assert sorted(j for h in layout for j in h) == list(range(world * per_rank))
        assert all(list(h) == sorted(h) for h in layout)
        balanced_layout.cache_clear()  # a pure function: the same answer computed afresh
        assert balanced_layout(doc_lens, world) == layout


def test_one_sequence_and_even_documents():
    """One document: zigzag, the layout that balances a full triangle. Equal documents on chunk boundaries: every
    rank the same area with two chunks each, and no document crosses a chunk, so the ring passes nothing."""
    assert cp_layout(4, None) == cp_layout(4, (4096,)) == parallel.zigzag_layout(4) == ((0, 7), (1, 6), (2, 5), (3, 4))
    assert balanced_layout((1 << 18,), 4) == parallel.zigzag_layout(4)  # the same by the area rule
    for doc_lens in [(65536,) * 4, (8192,) * 32]:
        layout = balanced_layout(doc_lens, 2)
        assert len(layout[0]) == 2 and excess(doc_lens, layout) == 0
        assert documents._last_step(doc_lens, True, 2) == 0


@pytest.mark.parametrize("world", [2, 4, 8])
def test_long_tailed_windows_are_balanced(world):
    """Windows of 262,144 and 1,048,576 tokens of long-tailed documents: the busiest rank's masked area within
    BALANCE_TOLERANCE of the mean (the target: 5%), where zigzag leaves some rank tens of percent above it."""
    zigzag = []
    for total in (1 << 18, 1 << 20):
        for seed in range(20):
            doc_lens = long_tailed(total, seed)
            assert excess(doc_lens, balanced_layout(doc_lens, world)) <= documents.BALANCE_TOLERANCE, (total, seed)
            zigzag.append(excess(doc_lens, parallel.zigzag_layout(world)))
    assert max(zigzag) > 0.2 and sorted(zigzag)[len(zigzag) // 2] > 0.05


def test_shard_round_trip_with_documents():
    x = torch.arange(2 * 4 * 64).view(2, -1)
    doc_lens = long_tailed(x.shape[1], 3, median=20)
    balanced_layout.cache_clear()
    for world in (1, 2, 4):
        for balanced in (True, False):
            layout = cp_layout(world, doc_lens, balanced)
            shards = [cp_shard(x, 1, r, world, layout) for r in range(world)]
            assert all(s.shape == (2, x.shape[1] // world) for s in shards)
            assert torch.equal(cp_unshard(shards, 1, layout), x)
    with pytest.raises(ValueError, match="divisible by 2\\*cp=4"):
        cp_shard(torch.zeros(10), 0, 0, 2)


def test_document_area_in_the_cost_model():
    """document_area: the busiest rank's masked area over its share of a full triangle; attention's predicted
    time (plan.py) scales with it and nothing else does."""
    t = 1 << 18
    assert document_area((t,), 2) == pytest.approx(1)
    assert document_area((t // 4,) * 4, 2) == pytest.approx(1 / 4, rel=1e-4)
    assert document_area((t // 32,) * 32, 2) == pytest.approx(1 / 32, rel=1e-3)
    doc_lens = long_tailed(t, 1)
    whole = sum(n * (n + 1) for n in doc_lens) / (t * (t + 1))  # the mask's share of the triangle
    assert whole <= document_area(doc_lens, 4) <= whole * (1 + documents.BALANCE_TOLERANCE)
    assert document_area(doc_lens, 4, balanced=False) > document_area(doc_lens, 4)
    s = plan.Shape.of(hf.read_config("bench/configs/qwen3-1.7b"), t, 2, 2, 2, attn_backend="fa4")
    lv = plan.Levers(0, 0)
    quarter = plan.replace(s, attn_area=0.25)
    attn = plan.attention_flops(s, lv) / (plan.FITTED.attn_tflops["fa4"] * 1e12)
    assert plan.step_seconds(s, lv) - plan.step_seconds(quarter, lv) == pytest.approx(0.75 * attn)
    assert plan.gpu_bytes(s, lv) == plan.gpu_bytes(quarter, lv)


def test_doc_lens_flag():
    assert parse_doc_lens("4x65536") == (65536,) * 4
    assert parse_doc_lens("2x3, 5") == (3, 3, 5)
    for bad in ("", "x", "4x", "3x-2", "a,b"):
        with pytest.raises(ValueError, match="--doc_lens"):
            parse_doc_lens(bad)
