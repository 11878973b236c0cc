"""retrieval.py against oracles: the scores of the answer tokens (argmax and NLL) equal those of transformers'
Qwen3ForCausalLM on the same window, at cp 1, 2 and 4 (ring attention under gloo; cp 2 x dp 2 too) and with
YaRN on and off; needles sit at their depth, windows have their exact length, keys never occur in the haystack
by chance; the chat form is the chat template's rendering; a random model scores at chance and a trained one
above it. train.py --retrieval true end to end under FSDP2 and the ring: tests/e2e/test_retrieval.py.

    python -m pytest tests/test_retrieval.py -q
"""
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import data
from million import plan
from million import retrieval as R
from million import chat
from million import hf as H
from model import Qwen3, Qwen3Config
from parallel import RingAttention
from test_ring import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = data.ByteTokenizer()
SOURCE = "synthetic:100"
GRID = R.Grid(lengths=[256, 768], depths=[0.0, 0.5, 1.0], keys=1)  # 256: a needle a window; 768: two


def tiny_config(yarn: bool) -> Qwen3Config:
    cfg = Qwen3Config.tiny(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8)
    return cfg.yarn_scaled(4.0, 128) if yarn else cfg


def windows() -> list:
    return R.build_windows(TOK, GRID, SOURCE, "validation", seed=0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """HF folders of a tiny random Qwen3 (vocab 257: the byte tokenizer), with YaRN and without; norms away from 1
    so that a missing one would show."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for yarn in (False, True):
        out[yarn] = root / ("yarn" if yarn else "rope")
        m = Qwen3(tiny_config(yarn))
        gen = torch.Generator().manual_seed(1)
        m.init_weights(gen)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if n.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5, generator=gen)
        H.save_pretrained(m, str(out[yarn]))
    return out


def hf_scores(folder, ws):
    """(nll, argmax) of each window's answer rows from transformers' full logits."""
    import transformers  # the independent reference (here, so that the ranks do not import it)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for w in ws:
            logits = hf(w.ids[None, :-1]).logits[0].double()                             # [L, V]
            rows, targets = R.answer_rows(w), w.labels()[R.answer_rows(w)]
            nll = torch.logsumexp(logits[rows], 1) - logits[rows, targets]
            out.append((nll, logits[rows].argmax(1)))
    return out


def same_scores(got, want, what):
    for i, ((nll, arg), (ref_nll, ref_arg)) in enumerate(zip(got, want)):
        assert torch.equal(arg, ref_arg), f"{what}, window {i}: argmax differs"
        torch.testing.assert_close(nll, ref_nll, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}, window {i}: {m}")


# --- the scores against transformers ------------------------------------------------------------

def _rank_main(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ws, results = windows(), {}
        for yarn in (False, True):
            m = H.from_pretrained(str(Path(out_dir) / ("yarn" if yarn else "rope")), dtype=torch.float32)
            m.attn_fn = RingAttention(dist.group.WORLD)
            results[f"cp{world}", yarn] = R.score(m, ws, dist.group.WORLD)
            if world == 4:  # cp 2 x dp 2, on an odd number of windows: the last round runs one window twice
                groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
                m.attn_fn = RingAttention(groups[rank // 2])
                results["cp2dp2", yarn] = R.score(m, ws, groups[rank // 2], dp_rank=rank // 2, dp=2)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_scores_equal_transformers(world, folders, tmp_path):
    """Argmax exactly and NLL to 1e-5 on every answer token of every window, at cp 1, 2 and 4, YaRN on and off;
    every rank returns the same scores."""
    ws = windows()
    for yarn, folder in folders.items():
        os.symlink(folder, tmp_path / folder.name)
    if world == 1:
        ranks = [{("cp1", yarn): R.score(H.from_pretrained(str(f), dtype=torch.float32), ws)
                  for yarn, f in folders.items()}]
    else:
        ranks = run_ranks(world, tmp_path, timeout=300, main=_rank_main)
    for yarn, folder in folders.items():
        want = hf_scores(folder, ws)
        for name in [f"cp{world}"] + (["cp2dp2"] if world == 4 else []):
            for r in ranks:
                same_scores(r[name, yarn], want, f"{name}, yarn {yarn}")
    assert len(ws) % 2 and sum(len(R.answer_rows(w)) for w in ws) == 2 * 3 * 6  # 6 bytes an answer: " 12345"


def test_random_model_scores_at_chance(folders):
    """No key retrieved, and each answer token's NLL near ln(257): the odds of a 5-digit key by chance are ~1e-12."""
    ws = windows()
    m = H.from_pretrained(str(folders[False]), dtype=torch.float32)
    cs = R.cells(ws, R.score(m, ws))
    assert [(c["length"], c["depth"], c["keys"]) for c in cs] == [(n, d, 1) for n in (256, 768) for d in (0, 0.5, 1)]
    assert all(c["exact_match"] == 0 for c in cs)
    assert all(abs(c["nll"] - math.log(257)) < 0.3 for c in cs), cs
    assert [x["length"] for x in R.by_length(cs)] == [256, 768]


def test_a_trained_model_retrieves_at_its_length():
    """The tiny Qwen3 of bench/retrieval_small.py (600 steps on passkey windows of 128 bytes; its weights, in
    bf16, are a fixture) retrieves most keys at 128 on books of the test split, which neither its training nor
    the bench read, and none at 8 x 128 with the RoPE it was trained with."""
    m = H.from_pretrained(str(Path(__file__).parent / "fixtures" / "passkey_qwen3"), dtype=torch.float32)
    ws = R.build_windows(TOK, R.Grid([128, 1024], [0.0, 0.5, 1.0], 4, 1), SOURCE, "test", seed=1)
    at_128, at_1024 = R.by_length(R.cells(ws, R.score(m, ws)))
    assert at_128["exact_match"] >= 0.6 and at_128["nll"] < 0.5, at_128
    assert at_1024["exact_match"] <= 0.1 and at_1024["nll"] > 2, at_1024

# --- the task: placement, exact length, keys ----------------------------------------------------

def sentence_iter(seed=0, books=40):
    texts = [data.synthetic_book(seed, i, 100) for i in range(books)]
    return list(R.filler(texts, TOK))


@pytest.mark.parametrize("length,depths", [(200, [0.3]), (1000, [0.0, 0.5, 1.0]), (4096, [0.05, 0.2, 0.9, 0.95])])
def test_needles_at_their_depth_in_a_window_of_exact_length(length, depths):
    pool = sentence_iter()
    w = R.build_window(TOK, iter(pool), length, depths, np.random.default_rng(3))
    assert w.length == length and w.ids.shape == (length + 1,) and w.ids[-1] == TOK.eos_id
    bounds = np.cumsum([0] + [len(ids) for ids, _ in pool])
    bounds = bounds[bounds <= w.filler].tolist() + [w.filler]  # the last sentence is cut at the filler's end
    text = TOK.decode(w.ids[:-1].tolist())
    labels = w.labels()
    assert (labels != -100).sum() == sum(b - a for n in w.needles for a, b in [n.answer])
    for n in sorted(w.needles, key=lambda n: n.depth):
        a, b = n.answer
        assert TOK.decode(w.ids[a:b].tolist()) == " " + n.key
        assert torch.equal(labels[a - 1:b - 1], w.ids[a:b])
        assert TOK.decode(w.ids[:a].tolist()).endswith(f"What is the {n.name} passkey? The {n.name} passkey is")
        sentence = f" The {n.name} passkey is {n.key}."
        assert TOK.decode(w.ids[n.start:n.start + len(sentence)].tolist()) == sentence
        assert text.count(n.key) == 2  # in its needle and its answer
        # the sentence boundary nearest to depth x filler, and the needle there (after the needles before it)
        target = n.depth * w.filler
        assert n.boundary in bounds and abs(n.boundary - target) == min(abs(x - target) for x in bounds)
        before = sum(len(f" The {m.name} passkey is {m.key}.") for m in w.needles if m.start < n.start)
        assert n.start == n.boundary + before
    assert w.haystack == (0, w.filler + sum(len(f" The {m.name} passkey is {m.key}.") for m in w.needles))


def test_keys_never_occur_in_the_haystack():
    """A key the filler holds is drawn again: the keys a seed draws first, written into the filler, are never
    drawn, and no key occurs in the haystack but in its needle."""
    first = R.draw_keys(np.random.default_rng(5), 3, "")
    assert R.draw_keys(np.random.default_rng(5), 3, "") == first and len(set(first)) == 3
    again = R.draw_keys(np.random.default_rng(5), 3, f"a {first[0]} b {first[2]}x")
    assert first[0] not in again and first[2] not in again
    with pytest.raises(ValueError, match="absent"):
        R.draw_keys(np.random.default_rng(0), 1, " ".join(str(k) for k in range(10000, 100000)))
    # in a window: the filler holds every key the same generator would draw first
    rng = np.random.default_rng(7)
    rng.choice(len(R.NAMES), 2, replace=False), rng.permutation(2)
    planted = R.draw_keys(rng, 2, "")
    clean = R.build_window(TOK, iter(sentence_iter()), 1000, [0.2, 0.8], np.random.default_rng(7))
    assert [n.key for n in clean.needles] == planted  # what the window draws when its filler holds no digits
    pool = [(TOK.encode(f" the number {k} is here"), f"the number {k} is here") for k in planted] + sentence_iter()
    w = R.build_window(TOK, iter(pool), 1000, [0.2, 0.8], np.random.default_rng(7))
    assert not set(planted) & {n.key for n in w.needles}
    hay = TOK.decode(w.ids[slice(*w.haystack)].tolist())
    for n in w.needles:
        assert hay.count(n.key) == 1


def test_windows_are_a_function_of_the_seed():
    a, b = windows(), windows()
    assert all(torch.equal(x.ids, y.ids) and x.needles == y.needles for x, y in zip(a, b))
    # per length: keys x ceil(depths / needles that fit) windows, each with a filler of its own
    assert [w.length for w in a] == [256] * 3 + [768] * 2
    assert [len(w.needles) for w in a] == [1, 1, 1, 2, 1]
    def filler_start(w):  # the first 20 filler tokens, the needles left out
        inside = {i for n in w.needles for i in range(n.start, n.start + len(f" The {n.name} passkey is {n.key}."))}
        return tuple(t for i, t in enumerate(w.ids.tolist()) if i not in inside)[:20]
    for length in GRID.lengths:  # window j of a length reads from book j on
        mine = [w for w in a if w.length == length]
        assert len({filler_start(w) for w in mine}) == len(mine)


def test_grid_flags():
    g = R.parse_grid("", "0,0.5,1", 3, 0, 1024, 4)
    assert g == R.Grid([1024], [0.0, 0.5, 1.0], 3, 0)
    assert R.parse_grid("2048,4_096", "1", 1, 2, 1024, 4).lengths == [2048, 4096]
    for lengths, depths, keys, needles, msg in [
            ("1000", "0", 1, 0, "multiple of 2\\*cp = 16"), ("", "0,1.5", 1, 0, "fractions"),
            ("", "0,0", 1, 0, "distinct"), ("", "0", 0, 0, "at least 1"), ("", "0", 1, -1, "0 or more"),
            ("a", "0", 1, 0, "numbers")]:
        with pytest.raises(ValueError, match=msg):
            R.parse_grid(lengths, depths, keys, needles, 1024, 8)
    # one needle a window: a window per depth and key
    ws = R.build_windows(TOK, R.Grid([768], [0.0, 0.5, 1.0], 2, 1), SOURCE, "validation", seed=0)
    assert [len(w.needles) for w in ws] == [1] * 6


# --- the chat form ------------------------------------------------------------------------------

def test_chat_form_is_the_templates_rendering(tmp_path):
    """Rendered through Qwen3's chat template with a BPE tokenizer: the window's text is render_chat's of the
    conversation (the haystack and first question, then an assistant turn per answer), of exact length, and
    the targets are the keys."""
    from test_rows import QWEN3, write_model
    folder = write_model(tmp_path / "model", {"chat_template": QWEN3})
    tok = data.load_tokenizer(str(folder))
    render = R.chat_renderer(folder)
    sents = R.filler((data.synthetic_book(0, i, 100) for i in range(100)), tok)
    w = R.build_window(tok, sents, 2000, [0.0, 0.5, 1.0], np.random.default_rng(0), render)
    assert w.ids.shape == (2001,) and w.ids[-1] == tok.eos_id
    order = sorted(w.needles, key=lambda n: n.answer)
    messages = []
    for i, n in enumerate(order):
        hay = tok.decode(w.ids[slice(*w.haystack)].tolist()) + "\n\n" if i == 0 else ""
        messages += [{"role": "user", "content": hay + f"What is the {n.name} passkey?"},
                     {"role": "assistant", "content": f"The {n.name} passkey is {n.key}."}]
    assert tok.decode(w.ids[:-1].tolist()) == chat.render_chat(QWEN3, messages, **chat.template_variables(folder))
    for n in w.needles:
        a, b = n.answer
        assert tok.decode(w.ids[a:b].tolist()) == " " + n.key
        before = tok.decode(w.ids[:a].tolist())
        assert before.endswith(f"The {n.name} passkey is")
        assert before.rsplit("<|im_start|>", 1)[1].startswith("assistant\n")  # in an assistant turn
        assert w.haystack[0] <= n.start < w.haystack[1]


# --- outputs, cost -------------------------------------------------------------------------------

def test_picture_is_skipped_without_matplotlib(monkeypatch, tmp_path):
    cs = [dict(length=256, depth=d, keys=1, exact_match=1.0, nll=0.1) for d in (0, 1)]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert R.plot([("a", cs)], str(tmp_path / "a.png")) is None and not (tmp_path / "a.png").exists()


def test_predicted_time_is_a_third_of_a_step():
    """A forward costs about a third of a step that recomputes nothing (Qwen3-8B, 1M tokens, cp 8)."""
    mcfg = H.read_config(os.path.join(ROOT, "bench", "configs", "qwen3-8b"))
    s = plan.Shape.of(mcfg, 1 << 20, 8, 8, 8)
    step = plan.step_seconds(s, plan.Levers(0, s.layers))
    assert 2.8 < step / plan.forward_seconds(s) < 4.0
    w = R.Window(torch.zeros(1), [], 1 << 20, 0, (0, 0))
    assert R.forward_seconds(s, [w] * 3, 2) == pytest.approx(2 * plan.forward_seconds(s))


# --- train.py end to end ------------------------------------------------------------------------


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_each_evaluation_writes_a_row_and_a_line(one_rank, folders, tmp_path, monkeypatch):
    """retrieval.run as train.py's evaluation calls it: a row per evaluation in retrieval.jsonl, the rows after a
    resumed run's step dropped when it evaluates again, --eval_only's row added to the earlier ones."""
    import train
    from million import config
    from torch.distributed.device_mesh import init_device_mesh
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    cfg = config.TrainConfig(model=str(folders[False]), tokenizer="byte", data=SOURCE, seq_len=256,
                            out_dir=str(tmp_path), retrieval=True, retrieval_depths="0,1", retrieval_keys=1,
                            device="cpu")
    m = H.from_pretrained(str(folders[False]), dtype=torch.float32)
    s = train.Setup(init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "cp")), m, m.cfg, str(folders[False]), {},
                    torch.device("cpu"))
    lines = []
    for step in (0, 10, 20, 10):  # the last: a run resumed after step 0 evaluates step 10 again
        row = R.run(cfg, s, step, lines.append)
    rows = [json.loads(x) for x in open(tmp_path / "retrieval.jsonl")]
    assert [r["step"] for r in rows] == [0, 10] and rows[1] == json.loads(json.dumps(row))
    R.run(dataclasses.replace(cfg, eval_only=True), s, 0, lines.append)
    assert [json.loads(x)["step"] for x in open(tmp_path / "retrieval.jsonl")] == [0, 10, 0]
    assert row["windows"] == 2 and [c["depth"] for c in row["cells"]] == [0.0, 1.0] and row["predicted_s"] is None
    assert sum(x.startswith("retrieval   10 | exact match by length: 256: 0% (nll ") for x in lines) == 2
    assert lines.count("retrieval: no picture (matplotlib is not installed); the numbers are in retrieval.jsonl") == 5


def test_chat_form_by_default_for_conversation_runs(tmp_path):
    """--retrieval_chat auto: the chat form when the run packs documents and the tokenizer has a chat template."""
    import train
    from million import config
    from test_rows import QWEN3, write_model
    with_template = data.load_tokenizer(str(write_model(tmp_path / "a", {"chat_template": QWEN3})))
    without = data.load_tokenizer(str(write_model(tmp_path / "b", {})))
    cfg = config.TrainConfig(packing="docs")
    assert R.chat_wanted(cfg, with_template)
    assert not R.chat_wanted(cfg, without) and not R.chat_wanted(cfg, TOK)
    assert not R.chat_wanted(dataclasses.replace(cfg, packing="concat"), with_template)
    assert not R.chat_wanted(dataclasses.replace(cfg, packing="auto", data="synthetic"), with_template)
    assert R.chat_wanted(dataclasses.replace(cfg, packing="concat", retrieval_chat="true"), TOK)


def test_a_source_without_text_stops_every_rank_with_a_message(one_rank, folders, tmp_path):
    import train
    from million import config
    from torch.distributed.device_mesh import init_device_mesh
    rows = tmp_path / "chats.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    cfg = config.TrainConfig(model=str(folders[False]), tokenizer="byte", retrieval_data=str(rows), seq_len=256,
                            out_dir=str(tmp_path), retrieval=True, device="cpu", packing="concat")
    m = H.from_pretrained(str(folders[False]), dtype=torch.float32)
    s = train.Setup(init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "cp")), m, m.cfg, None, {},
                    torch.device("cpu"))
    with pytest.raises(SystemExit, match="has no field 'text'.*--retrieval_data names another source of text"):
        R.run(cfg, s, 0, print)


def test_train_py_checks_the_flags_before_any_work():
    from million import config
    cfg = config.TrainConfig(device="cpu", seq_len=4096, retrieval=True)
    for kw, msg in [(dict(), "runs with each evaluation: set --eval_every N or --eval_only true"),
                    (dict(eval_every=5, retrieval_lengths="1000"), "multiple of 2\\*cp = 16"),
                    (dict(eval_only=True, retrieval_chat="yes"), "--retrieval_chat yes: auto, true or false")]:
        with pytest.raises(SystemExit, match=msg):
            config.check_config(dataclasses.replace(cfg, **kw), 8)
    config.check_config(dataclasses.replace(cfg, eval_every=5, retrieval_lengths="4096,8192"), 8)  # passes
