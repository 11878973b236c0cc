"""loss.chunked_nll against a float64 full-logits cross-entropy written here: values, gradients, ignored rows,
cost (matmul FLOPs, largest tensor) and errors. CPU only, a few seconds.

    python -m pytest tests/test_loss.py -q
"""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import loss  # noqa: E402
from loss import chunked_nll  # noqa: E402


def make(N, V, H, dtype=torch.float32, seed=0, logit_std=3.0, ignore=(), ignore_index=-100):
    """Inputs with logits of std ~logit_std (a peaked softmax, as in a trained model), some labels ignored."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()                          # [N, H]
    weight = (torch.randn(V, H, generator=g) * logit_std / H**0.5).to(dtype).requires_grad_()    # [V, H]
    labels = torch.randint(0, V, (N,), generator=g)                                              # [N]
    labels[list(ignore)] = ignore_index
    return hidden, weight, labels


def oracle(hidden, weight, labels, ignore_index=-100, scale=1.0):
    """float64 full logits and F.cross_entropy: (loss_sum, n_valid, grad_hidden, grad_weight)."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    loss = F.cross_entropy(h @ w.T, labels, ignore_index=ignore_index, reduction="sum")
    (loss * scale).backward()
    return loss.detach(), int((labels != ignore_index).sum()), h.grad, w.grad


def close(actual, expected, rtol):
    """Elementwise closeness with the tolerance scaled to the tensor's magnitude (gradients have tiny entries)."""
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=rtol * expected.abs().max().item())


def rel_err(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("V", [1001, 997])
@pytest.mark.parametrize("chunk", [1, 7, 37, 64])  # one row, awkward, exactly N, more than N
def test_fp32_matches_float64_oracle(V, chunk):
    hidden, weight, labels = make(37, V, 24, ignore=[0, 5, 36])
    loss_sum, n_valid = chunked_nll(hidden, weight, labels, chunk_size=chunk)
    loss_sum.backward()
    ref_loss, ref_n, ref_dh, ref_dw = oracle(hidden, weight, labels)
    assert loss_sum.dtype == torch.float32 and loss_sum.dim() == 0
    assert n_valid.dtype == torch.int64 and n_valid.dim() == 0 and not n_valid.requires_grad
    assert int(n_valid) == ref_n == 34
    torch.testing.assert_close(loss_sum.double(), ref_loss, rtol=1e-6, atol=0)
    close(hidden.grad, ref_dh, 1e-5)
    close(weight.grad, ref_dw, 1e-5)
    assert hidden.grad[[0, 5, 36]].abs().max() == 0  # ignored rows get exactly zero gradient


@pytest.mark.parametrize("scale", [1.0, 3.5 / 129])  # grad_output of loss_sum, and of 3.5 * loss_sum / n_valid
@pytest.mark.parametrize("chunk", [1, 7, 131, 200])
def test_bf16_matches_oracle_and_is_no_worse_than_naive_bf16(chunk, scale):
    N, V, H = 131, 1001, 24
    hidden, weight, labels = make(N, V, H, dtype=torch.bfloat16, seed=1, ignore=[3, 20])
    loss_sum, _ = chunked_nll(hidden, weight, labels, chunk_size=chunk)
    (loss_sum * scale).backward()
    ref_loss, _, ref_dh, ref_dw = oracle(hidden, weight, labels, scale=scale)
    # Logits and log-sum-exp in fp32 from exact bf16 operands: the loss is as good as an fp32 one.
    torch.testing.assert_close(loss_sum.double(), ref_loss, rtol=1e-6, atol=0)
    # Gradients come back in bf16, so each element carries up to half a bf16 ulp (2^-9 relative). Against
    # the oracle rounded once to bf16 (measured: 1.04-1.09x for this loss), grad_weight rounded per chunk
    # comes out 1.5-2.7x, and a bf16 grad_weight scaled by grad_output after rounding ~1.5x.
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    close(hidden.grad, ref_dh, 2e-2)
    close(weight.grad, ref_dw, 2e-2)
    err_dw, floor_dw = rel_err(weight.grad, ref_dw), rel_err(ref_dw.bfloat16(), ref_dw)
    assert err_dw < 1.25 * floor_dw, (err_dw, floor_dw)
    if scale == 1.0:  # grad_hidden is kept in bf16 from forward to backward, so scaling it rounds twice
        err_dh, floor_dh = rel_err(hidden.grad, ref_dh), rel_err(ref_dh.bfloat16(), ref_dh)
        assert err_dh < 1.25 * floor_dh, (err_dh, floor_dh)
    # The naive path: bf16 logits, softmax on an fp32 copy, autograd. grad_weight must be at least as good.
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    (F.cross_entropy((h @ w.T).float(), labels, reduction="sum") * scale).backward()
    assert err_dw <= rel_err(w.grad, ref_dw), (err_dw, rel_err(w.grad, ref_dw))


def test_bf16_confident_rows():
    """p(target) near 1: the gradient p - 1 is small and must be formed in fp32 before rounding to bf16."""
    hidden, weight, _ = make(37, 1001, 24, dtype=torch.bfloat16, seed=3, logit_std=10.0)
    labels = (hidden.double() @ weight.double().T).argmax(1)  # median p(target) 0.86 here
    chunked_nll(hidden, weight, labels, chunk_size=7)[0].backward()
    _, _, ref_dh, _ = oracle(hidden, weight, labels)
    row_err = (hidden.grad.double() - ref_dh).norm(dim=1) / ref_dh.norm(dim=1)                  # [N]
    assert row_err.max() < 2e-2, row_err.max()  # measured 4e-3; rounding p first gives ~1


def test_grad_output_is_applied():
    hidden, weight, labels = make(29, 1001, 16, ignore=[2])
    loss_sum, n_valid = chunked_nll(hidden, weight, labels, chunk_size=8)
    (loss_sum * 3.5 / n_valid).backward()
    _, n, ref_dh, ref_dw = oracle(hidden, weight, labels, scale=3.5 / 28)
    assert n == 28
    close(hidden.grad, ref_dh, 1e-5)
    close(weight.grad, ref_dw, 1e-5)


def test_grads_accumulate_and_second_backward_refuses():
    hidden, weight, labels = make(11, 101, 8)
    _, _, ref_dh, ref_dw = oracle(hidden, weight, labels)
    for _ in range(2):  # .grad accumulates over two separate forwards like any other loss
        chunked_nll(hidden, weight, labels, chunk_size=4)[0].backward()
    close(hidden.grad, 2 * ref_dh, 1e-5)
    close(weight.grad, 2 * ref_dw, 1e-5)
    loss_sum, _ = chunked_nll(hidden, weight, labels, chunk_size=4)
    loss_sum.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss_sum.backward()


@pytest.mark.parametrize("ignore_index", [-1, 3])  # a negative one, and one that is also a vocabulary id
def test_custom_ignore_index(ignore_index):
    hidden, weight, labels = make(23, 53, 12, seed=2)
    labels[[1, 4, 9, 22]] = ignore_index  # with ignore_index 3, rows whose target is token 3 are ignored too
    loss_sum, n_valid = chunked_nll(hidden, weight, labels, ignore_index=ignore_index, chunk_size=5)
    loss_sum.backward()
    ref_loss, ref_n, ref_dh, ref_dw = oracle(hidden, weight, labels, ignore_index=ignore_index)
    assert int(n_valid) == ref_n == int((labels != ignore_index).sum()) <= 19
    torch.testing.assert_close(loss_sum.double(), ref_loss, rtol=1e-6, atol=0)
    close(hidden.grad, ref_dh, 1e-5)
    close(weight.grad, ref_dw, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_ignored_still_gives_zero_gradients(dtype):
    """Under FSDP every rank must run the same backward, also a rank whose labels are all ignored."""
    hidden, weight, labels = make(13, 101, 8, dtype=dtype, ignore=range(13))
    loss_sum, n_valid = chunked_nll(hidden, weight, labels)
    assert int(n_valid) == 0 and loss_sum.item() == 0.0 and loss_sum.requires_grad
    loss_sum.backward()
    assert weight.grad is not None and weight.grad.dtype == dtype and weight.grad.abs().max() == 0
    assert hidden.grad is not None and hidden.grad.abs().max() == 0


def test_only_the_inputs_that_need_grad_get_it():
    hidden, weight, labels = make(19, 211, 10, ignore=[4])
    _, _, ref_dh, ref_dw = oracle(hidden, weight, labels)
    frozen = weight.detach()
    chunked_nll(hidden, frozen, labels, chunk_size=6)[0].backward()
    close(hidden.grad, ref_dh, 1e-5)
    assert frozen.grad is None
    frozen_h = hidden.detach()
    chunked_nll(frozen_h, weight, labels, chunk_size=6)[0].backward()
    close(weight.grad, ref_dw, 1e-5)
    with torch.no_grad():  # evaluation: the value, no graph
        loss_sum, _ = chunked_nll(hidden, weight, labels, chunk_size=6)
    assert not loss_sum.requires_grad
    torch.testing.assert_close(loss_sum.double(), oracle(hidden, weight, labels)[0], rtol=1e-6, atol=0)


def test_runs_with_autocast_on():
    hidden, weight, labels = make(17, 97, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_sum, _ = chunked_nll(hidden, weight, labels, chunk_size=5)
    loss_sum.backward()
    ref_loss, _, ref_dh, _ = oracle(hidden, weight, labels)
    torch.testing.assert_close(loss_sum.double(), ref_loss, rtol=1e-6, atol=0)  # fp32, not autocast's bf16
    close(hidden.grad, ref_dh, 1e-5)


@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)])
def test_matmul_flops_cover_only_the_valid_rows(needs):
    """3 matmuls per valid row (logits, dH, dW), none for ignored rows, none in backward: a test of cost."""
    N, V, H = 40, 301, 16
    hidden, weight, labels = make(N, V, H, ignore=range(0, N, 3))  # 14 of 40 rows ignored
    hidden.requires_grad_(needs[0])
    weight.requires_grad_(needs[1])
    n_valid = int((labels != -100).sum())
    with FlopCounterMode(display=False) as fwd:
        loss_sum, _ = chunked_nll(hidden, weight, labels, chunk_size=9)
    with FlopCounterMode(display=False) as bwd:
        loss_sum.backward()
    assert n_valid == 26
    assert fwd.get_total_flops() == 2 * n_valid * V * H * (1 + sum(needs))
    assert bwd.get_total_flops() == 0


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.numel = max([self.numel, *sizes])
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_never_materialises_the_full_logits(dtype):
    N, V, H, chunk = 64, 1001, 8, 16  # chunk x V = 16,016 elements; N x V = 64,064; V x H = 8,008
    hidden, weight, labels = make(N, V, H, dtype=dtype)
    with LargestTensor() as largest:
        loss_sum, _ = chunked_nll(hidden, weight, labels, chunk_size=chunk)
        loss_sum.backward()
    assert largest.numel == chunk * V  # one chunk of logits at a time, and it is seen


def test_fused_part_compiles_as_one_graph():
    """On CUDA _nll_and_dlogits runs through torch.compile; check here that it traces whole, and still agrees."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 50, generator=gen, dtype=torch.float32) * 4                              # [c, V]
    y = torch.randint(0, 50, (6, 1), generator=gen)                                             # [c, 1]
    compiled = torch.compile(loss._nll_and_dlogits, dynamic=True, fullgraph=True, backend="aot_eager")
    got_loss, got_g = compiled(x, y, torch.bfloat16)
    ref = x.double().requires_grad_()
    F.cross_entropy(ref, y[:, 0], reduction="sum").backward()
    torch.testing.assert_close(got_loss.double(), F.cross_entropy(x.double(), y[:, 0], reduction="none"),
                               rtol=1e-6, atol=0)  # [c]: one NLL per row
    assert got_g.dtype == torch.bfloat16
    close(got_g, ref.grad, 1e-2)


@pytest.mark.parametrize("grad", [True, False])  # the training path (fused) and the evaluation path (logsumexp)
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_row_nll_is_each_rows_loss(grad, chunk):
    """.row_nll [N]: each row's NLL against the float64 per-row cross-entropy, 0 on ignored rows, summing to
    loss_sum; and the result still unpacks and indexes as (loss_sum, n_valid)."""
    hidden, weight, labels = make(37, 997, 24, ignore=[0, 5, 36])
    with torch.set_grad_enabled(grad):
        out = chunked_nll(hidden, weight, labels, chunk_size=chunk)
    ref = F.cross_entropy(hidden.detach().double() @ weight.detach().double().T, labels, reduction="none")  # [N]
    assert out.row_nll.shape == (37,) and out.row_nll.dtype == torch.float32 and not out.row_nll.requires_grad
    torch.testing.assert_close(out.row_nll.double(), ref, rtol=1e-5, atol=1e-6)
    assert (out.row_nll[[0, 5, 36]] == 0).all()
    torch.testing.assert_close(out.row_nll.double().sum(), out.loss_sum.double(), rtol=1e-6, atol=0)
    loss_sum, n_valid = out
    assert loss_sum is out[0] is out.loss_sum and n_valid is out[1] and len(out) == 2 and int(n_valid) == 34
    if grad:  # row_nll is a by-product: the gradients are loss_sum's alone
        loss_sum.backward()
        close(hidden.grad, oracle(hidden, weight, labels)[2], 1e-5)


def test_row_nll_sums_by_position():
    """What train.py does with row_nll: sums over buckets of position (index_add) equal the per-row oracle's
    sums over the same spans, and add up to loss_sum."""
    N, K = 50, 4  # 50 rows into 4 buckets: spans of 13, 12, 13, 12 rows (not equal: 4 does not divide 50)
    hidden, weight, labels = make(N, 101, 16, ignore=[3, 49])
    out = chunked_nll(hidden, weight, labels, chunk_size=9)
    bucket = torch.arange(N) * K // N                                                            # [N]
    sums = torch.zeros(K).index_add_(0, bucket, out.row_nll)
    ref = F.cross_entropy(hidden.detach().double() @ weight.detach().double().T, labels, reduction="none")
    want = torch.stack([ref[bucket == b].sum() for b in range(K)])
    torch.testing.assert_close(sums.double(), want, rtol=1e-5, atol=0)
    torch.testing.assert_close(sums.sum(), out.loss_sum.detach(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(chunk_size=0), "chunk_size must be an int >= 1"),
    (dict(chunk_size=-3), "chunk_size must be an int >= 1"),
    (dict(chunk_size=2.5), "chunk_size must be an int >= 1"),
    (dict(hidden=torch.zeros(5, 7)), r"hidden \(5, 7\), weight \(11, 8\)"),
    (dict(labels=torch.zeros(4, dtype=torch.long)), r"labels \(4,\)"),
    (dict(labels=torch.zeros(5, 1, dtype=torch.long)), r"labels \(5, 1\)"),
    (dict(weight=torch.zeros(11, 8, dtype=torch.float64)), "share a floating dtype"),
    (dict(labels=torch.zeros(5)), "labels must be integers"),
    (dict(labels=torch.tensor([0, 1, 11, 2, -100])), r"\[0, 11\).*got values in \[0, 11\]"),
    (dict(labels=torch.tensor([0, -5, 1, 2, 3])), r"got values in \[-5, 3\]"),
])
def test_bad_inputs_raise_value_error(kwargs, message):
    args = dict(hidden=torch.zeros(5, 8), weight=torch.zeros(11, 8), labels=torch.zeros(5, dtype=torch.long))
    args.update(kwargs)
    chunk = args.pop("chunk_size", 4)
    with pytest.raises(ValueError, match=message):
        chunked_nll(args["hidden"], args["weight"], args["labels"], chunk_size=chunk)


@pytest.mark.gpu  # the CUDA path: mixed-dtype GEMMs and the compiled softmax
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_float64_oracle(dtype):
    hidden, weight, labels = make(300, 1001, 64, dtype=dtype, seed=4, ignore=[0, 299])
    hidden, weight = (t.detach().cuda().requires_grad_() for t in (hidden, weight))
    loss_sum, n_valid = chunked_nll(hidden, weight, labels.cuda(), chunk_size=128)
    (loss_sum / n_valid).backward()
    ref_loss, ref_n, ref_dh, ref_dw = oracle(hidden.cpu(), weight.cpu(), labels, scale=1 / 298)
    assert int(n_valid) == ref_n == 298 and loss_sum.is_cuda
    torch.testing.assert_close(loss_sum.double().cpu(), ref_loss, rtol=1e-5, atol=0)  # fp32 logits even in bf16
    rtol = 1e-3 if dtype == torch.float32 else 2e-2  # fp32 matmuls may run in TF32 where it is enabled
    close(hidden.grad.cpu(), ref_dh, rtol)
    close(weight.grad.cpu(), ref_dw, rtol)
    assert rel_err(weight.grad.cpu(), ref_dw) < 1.25 * rel_err(ref_dw.to(dtype), ref_dw) + 1e-6
