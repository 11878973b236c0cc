"""Chunked next-token NLL over `hidden @ weight.T` that never holds the [tokens x vocab] logits: at 131,072
tokens per GPU and Qwen3's vocabulary of 151,936 they would be 40 GB in bf16. The rows go through a chunk at a
time and each chunk's gradients are computed right there, in the forward pass, so that backward only scales two
saved tensors: 3 matmuls per chunk (logits, dH, dW) instead of the 4 of a loss that recomputes the logits in
backward. Operands stay in the input dtype (bf16 on tensor cores), log-sum-exp and softmax are done in fp32, and
grad_weight is accumulated across chunks in fp32.

    python -m pytest tests/test_loss.py -q     # CPU
    python bench/bench_loss.py                 # H200: time and memory by chunk size (bench/results/loss.json)
"""
import dataclasses
import functools

import torch


def mm_fp32(a, b):
    """a [m, k] @ b [k, n] -> [m, n] fp32, never rounded to bf16 on the way."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)  # bf16 tensor-core GEMM with an fp32 epilogue
    return a.float() @ b.float()  # CPU has no mixed-dtype GEMM; widening bf16 is exact, so the math is the same


def addmm_fp32_(acc, a, b):
    """acc += a @ b for an fp32 acc, the operands in their own dtype, with no [m, n] temporary."""
    if a.dtype != acc.dtype and a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)  # the GEMM epilogue adds into the fp32 buffer
    elif a.dtype != acc.dtype:
        torch.addmm(acc, a.float(), b.float(), out=acc)
    else:
        torch.addmm(acc, a, b, out=acc)


def _nll_and_dlogits(x, y, grad_dtype):
    """-log softmax(x)[y] per row, and dlogits = softmax(x) - onehot(y) in grad_dtype, the math in fp32: x [c, V]
    fp32 logits, y [c, 1] targets -> ([c] fp32, [c, V] grad_dtype). Plain formulas, so that torch.compile fuses
    them into one kernel that reads x twice and writes dlogits once."""
    m = x.amax(1, keepdim=True)                                                                 # [c, 1]
    e = torch.exp(x - m)                                                                        # [c, V]
    s = e.sum(1, keepdim=True)                                                                  # [c, 1]
    loss = (m + s.log() - x.gather(1, y)).squeeze(1)  # [c]: -log softmax(x)[y] = logsumexp(x) - x[y]
    onehot = (torch.arange(x.shape[1], device=x.device) == y).to(x.dtype)                       # [c, V]
    # p - 1 is formed in fp32 before the one rounding to bf16: rounding p first would turn a confident
    # p = 0.999 into 1.0 and its gradient -0.001 into 0.
    return loss, (e / s - onehot).to(grad_dtype)


@functools.cache
def _fused_nll_and_dlogits():
    """The compiled _nll_and_dlogits for CUDA, built on first use (importing the compiler takes seconds)."""
    return torch.compile(_nll_and_dlogits, dynamic=True)  # dynamic: the last chunk is shorter


class _ChunkedNLL(torch.autograd.Function):
    """Forward returns the summed NLL (and, not differentiable, each row's) and keeps its gradients; backward
    scales them by grad_output."""

    @staticmethod
    def forward(ctx, hidden, weight, rows, targets, chunk_size, need_dh, need_dw):
        # hidden [N, H], weight [V, H], rows [n] indices of the non-ignored rows, targets [n] their labels
        V, H = weight.shape
        row_nll = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)      # [N]
        dh = torch.zeros_like(hidden) if need_dh else None                                      # [N, H]
        dw = torch.zeros(V, H, dtype=torch.float32, device=weight.device) if need_dw else None  # [V, H] fp32
        for start in range(0, rows.numel(), chunk_size):
            idx, y = rows[start:start + chunk_size], targets[start:start + chunk_size, None]    # [c], [c, 1]
            h = hidden.index_select(0, idx)                                                     # [c, H]
            x = mm_fp32(h, weight.T)                                                            # [c, V] fp32
            if not (need_dh or need_dw):  # evaluation: the loss alone
                row_nll.index_copy_(0, idx, torch.logsumexp(x, 1) - x.gather(1, y).squeeze(1))
                continue
            nll = _fused_nll_and_dlogits() if x.is_cuda else _nll_and_dlogits
            chunk_nll, g = nll(x, y, hidden.dtype)                                        # [c] fp32, g [c, V]
            row_nll.index_copy_(0, idx, chunk_nll)
            del x  # the chunk peak is then 6 B per [c, V] element: fp32 logits while bf16 g is written
            if need_dh:
                dh.index_copy_(0, idx, g @ weight)                                              # [c, H]
            if need_dw:
                addmm_fp32_(dw, g.T, h)                                               # [V, H] += [V, c] @ [c, H]
            del g  # else it lives on while the next chunk's logits are made: 8 B per element, not 6
        # grad_weight stays fp32 until backward, where it is scaled (by 1 / token count, say) and rounded to
        # bf16 once: rounding per chunk, or before the scaling, adds error (tests/test_loss.py)
        ctx.grads, ctx.weight_dtype = (dh, dw), weight.dtype
        ctx.mark_non_differentiable(row_nll)
        return row_nll.sum(), row_nll

    @staticmethod
    def backward(ctx, grad_loss, grad_rows):
        if ctx.grads is None:
            raise RuntimeError("chunked_nll: backward ran twice; its saved gradients are scaled in place")
        dh, dw = ctx.grads
        ctx.grads = None  # hand the buffers over rather than copying them (grad_weight is 2.5 GB in fp32)
        if dh is not None:
            dh.mul_(grad_loss)
        if dw is not None and dw.dtype == ctx.weight_dtype:
            dw.mul_(grad_loss)
        elif dw is not None:  # scale in fp32 and round to bf16 in one pass
            dw = torch.mul(dw, grad_loss, out=torch.empty_like(dw, dtype=ctx.weight_dtype))
        return dh, dw, None, None, None, None, None


@dataclasses.dataclass
class NLL:
    """What chunked_nll returns. It unpacks and indexes as the pair (loss_sum, n_valid) that callers use;
    row_nll comes on top. A dataclass rather than a tuple subclass: FSDP2 rebuilds a module's output container
    to hook its tensors, and it rebuilds a dataclass field by field but a tuple from its items alone."""
    loss_sum: torch.Tensor  # fp32 scalar, connected to the graph
    n_valid: torch.Tensor   # int64 scalar
    row_nll: torch.Tensor   # [N] fp32, each row's NLL (0 for ignored rows); not differentiable

    def __iter__(self):
        return iter((self.loss_sum, self.n_valid))

    def __getitem__(self, i):
        return (self.loss_sum, self.n_valid)[i]

    def __len__(self):
        return 2


def chunked_nll(hidden, weight, labels, ignore_index=-100, chunk_size=2048) -> NLL:
    """Summed next-token NLL of `labels` under softmax(hidden @ weight.T), without the [N, V] logits.

    hidden [N, H] and weight [V, H] share a dtype (bf16 on GPU; fp32 or bf16 on CPU); labels [N] are integers;
    rows whose label is `ignore_index` are skipped, not computed. Returns (loss_sum, n_valid): an fp32 scalar
    connected to the graph (also when every label is ignored: under FSDP every rank must run the same backward)
    and an int64 scalar, so that ranks can divide by the global count of target tokens; plus `.row_nll` [N]
    fp32, each row's NLL (0 where ignored), which train.py sums by position in the sequence. Memory: an fp32
    [V, H] grad_weight plus 6 * chunk_size * V bytes (1.7 GiB at the default chunk and V = 151,936)."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1 or hidden.shape[1] != weight.shape[1] \
            or hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"need hidden [N, H], weight [V, H], labels [N]; got hidden {tuple(hidden.shape)}, "
                         f"weight {tuple(weight.shape)}, labels {tuple(labels.shape)}")
    if hidden.dtype != weight.dtype or not hidden.is_floating_point():
        raise ValueError(f"hidden and weight must share a floating dtype, got {hidden.dtype} and {weight.dtype}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integers, got {labels.dtype}")
    valid = labels != ignore_index                                                              # [N] bool
    rows = valid.nonzero().squeeze(1)                                                           # [n]
    targets = labels.index_select(0, rows).long()                                               # [n]
    lo, hi = torch.stack(torch.aminmax(targets)).tolist() if targets.numel() else (0, 0)
    if lo < 0 or hi >= weight.shape[0]:  # checked here: on CUDA a bad index is an unrecoverable device assert
        raise ValueError(f"labels must lie in [0, {weight.shape[0]}) or equal ignore_index={ignore_index}, "
                         f"got values in [{lo}, {hi}]")
    grad_on = torch.is_grad_enabled()  # forward() below runs with grad off, so decide here
    with torch.autocast(hidden.device.type, enabled=False):  # the dtypes above are the ones the math uses
        loss_sum, row_nll = _ChunkedNLL.apply(hidden, weight, rows, targets, chunk_size,
                                              grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
    return NLL(loss_sum, valid.sum(), row_nll)
