"""The fastest CUDA attention kernels for the ring: FlashAttention-4, cuDNN, flash, chosen once per run.

An extension of parallel.py: RingAttention(group, Kernels(backend)) runs its blocks on them (train.py's
--attn_backend). They return each query row's log-sum-exp, as the ring's merge needs, and take GQA and the model's
[B, T, H, D] memory seen as [B, H, T, D] as they are. Where they decline, parallel.py's own kernels run (PyTorch's
flash ops; the CPU op for CPU tensors, whatever the backend).

    pytest -m gpu tests/test_fa4.py tests/test_gpu.py   # against fp64 attention (needs a GPU; FA4 flash-attn-4)
    python bench/fa4_attn.py                            # each backend's time and error, per shape
"""
import functools
import warnings

import torch

import parallel

# fa4 (FlashAttention-4, sm90+: the fastest), cudnn (the fastest in PyTorch), flash (FlashAttention-2, where cuDNN
# refuses an input). How they compare: bench/NOTES.md, "kernels.py".
ATTN_BACKENDS = ("auto", "fa4", "cudnn", "flash")
_warned = set()


def _warn_once(key, msg):
    """One warning per key, not one per layer and step."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, stacklevel=3)


@functools.cache
def fa4_unavailable():
    """Why FlashAttention-4 cannot run here, or None when it can. Imported only here and in the FA4 calls: CI has
    no GPU and no flash-attn-4, and importing the CuTe DSL costs a few seconds."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"it needs an sm90 (Hopper) or newer GPU, this one is sm{major}{minor}"
    try:
        import flash_attn.cute.interface  # noqa: F401
    except Exception as e:  # ImportError, or the DSL failing to load its libraries
        return f"flash_attn.cute does not import ({type(e).__name__}: {str(e)[:200]})"
    return None


def cudnn_leads(head_dim, packed) -> bool:
    """Where cuDNN beats FA4 though FA4 runs: head_dim 256 (Qwen3.5) on an H100, whose backward there runs 416
    TFLOP/s on cuDNN and 372 on FA4, 3-5% of a whole step; on an H200 FA4 leads (435 against 410). Measured on
    whole sequences (bench/NOTES.md, "kernels.py"); packed documents keep FA4, whose blocks of pieces are one call
    (documents.py) where cuDNN's are one call per piece."""
    return bool(head_dim and head_dim > 128 and not packed and "H100" in torch.cuda.get_device_name())


def resolve_backend(backend="auto", head_dim=None, packed=False):
    """The attention kernels that `backend` (one of ATTN_BACKENDS) means on this machine for heads of head_dim,
    packed documents or not: "fa4", "cudnn" or "flash", or "cpu" where CUDA is unavailable. "auto" takes fa4 where
    it imports and the GPU is sm90 or newer, unless cuDNN leads there (cudnn_leads), else cudnn (which falls back
    to flash where it refuses an input)."""
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"attention backend {backend!r}: want one of {', '.join(ATTN_BACKENDS)}")
    if backend == "fa4" and fa4_unavailable():
        raise ValueError(f"attention backend fa4: {fa4_unavailable()}; install it with `pip install flash-attn-4` "
                         "(sm90+ GPUs) or pass --attn_backend cudnn")
    if not torch.cuda.is_available():
        return "cpu"
    if backend == "auto":
        return "cudnn" if fa4_unavailable() or cudnn_leads(head_dim, packed) else "fa4"
    return backend


# cuDNN's attention kills the process (a segfault, no error to catch) in backward on a piece of a few tokens, as
# a document mask makes (a one-token document; a document's last token in a chunk): bench/results/short_pieces.json.
# Such pieces run on flash attention, whose cost there is nil.
CUDNN_MIN_TOKENS = 16


def _choose(backend, device, q=None, k=None):
    """The kernels for tensors on `device`: "cpu" for CPU tensors, whatever the backend; flash for the short
    pieces cuDNN cannot run."""
    if device.type == "cpu":
        return "cpu"
    choice = resolve_backend("auto" if backend == "cpu" else backend)
    if choice == "cudnn" and q is not None and min(q.shape[2], k.shape[2]) < CUDNN_MIN_TOKENS:
        return "flash"
    return choice


def _cudnn_refused(e):
    """cuDNN declines inputs it has no plan for with a RuntimeError that names it; those run on flash. Anything
    else (out of memory above all: a retry on another kernel would hide it) is not a refusal."""
    return not isinstance(e, torch.OutOfMemoryError) and "cudnn" in str(e).lower()


def _fa4_fwd(q, k, v, causal):
    from flash_attn.cute.interface import _flash_attn_fwd
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, T, H, D], the model's memory
    out, lse = _flash_attn_fwd(q, k, v, causal=causal, return_lse=True)[:2]  # lse [B, Hq, Tq] fp32, natural log
    return out.transpose(1, 2), lse


def _fa4_bwd(dout, q, k, v, out, lse, causal):
    from flash_attn.cute.interface import _flash_attn_bwd
    q, k, v, out, dout = (x.transpose(1, 2) for x in (q, k, v, out, dout))
    grads = _flash_attn_bwd(q, k, v, out, dout, lse, causal=causal)
    return tuple(g.transpose(1, 2) for g in grads[:3])


def attn_fwd(q, k, v, causal, backend="auto"):
    """parallel._attn_fwd on the kernels of `backend`: q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] -> out [B, Hq, Tq, D]
    in q.dtype, lse [B, Hq, Tq] fp32 (natural log). causal is used only with Tq == Tk (where cuDNN's top-left and
    FlashAttention's bottom-right masks agree): query i sees keys 0..i."""
    choice = _choose(backend, q.device, q, k)
    if choice == "fa4":
        return _fa4_fwd(q, k, v, causal)
    if choice == "cudnn":
        try:
            out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)[:2]
            return out, lse.reshape(out.shape[:3])  # cuDNN's lse is [B, Hq, Tq, 1]
        except RuntimeError as e:
            if not _cudnn_refused(e):
                raise
            _warn_once("forward", f"cuDNN attention refused an input in forward ({str(e)[:200]}); such "
                       "inputs run on flash attention, slower")
    return parallel._attn_fwd(q, k, v, causal)  # flash, or the CPU op


def _bwd_call(dout, q, k, v, out, lse, causal, choice):
    if choice == "fa4":
        return _fa4_bwd(dout, q, k, v, out, lse, causal)
    if choice == "cudnn":
        tq, tk = q.shape[2], k.shape[2]
        rng = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout seed/offset: unused at p = 0
        try:
            return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, k, v, out, lse.contiguous().unsqueeze(-1), rng, rng, None, None, None, tq, tk, 0.0, causal)
        except RuntimeError as e:
            if not _cudnn_refused(e):
                raise
            _warn_once("backward", f"cuDNN attention refused an input in backward ({str(e)[:200]}); such "
                       "inputs run on flash attention, slower")
    return parallel._attn_bwd_call(dout, q, k, v, out, lse, causal)  # flash, or the CPU op


def attn_bwd(dout, q, k, v, out, lse, causal, heads_per_call=None, backend="auto"):
    """Gradients of one attn_fwd call from its inputs, out (in q.dtype) and lse [B, Hq, Tq] fp32, over groups of
    heads_per_call query heads (parallel._by_head_groups). -> dq [B, Hq, Tq, D], dk/dv [B, Hkv, Tk, D], in q.dtype."""
    call = functools.partial(_bwd_call, causal=causal, choice=_choose(backend, q.device, q, k))
    return parallel._by_head_groups(call, dout, q, k, v, out, lse, heads_per_call)


class Kernels:
    """RingAttention's kernels for `backend` (one of ATTN_BACKENDS), the model's head_dim and packed documents or
    not, resolved once here: self.backend says which run ("fa4", "cudnn", "flash", or "cpu" without CUDA)."""

    def __init__(self, backend="auto", head_dim=None, packed=False):
        self.backend, self.head_dim = resolve_backend(backend, head_dim, packed), head_dim

    def fwd(self, q, k, v, causal):
        return attn_fwd(q, k, v, causal, self.backend)

    def bwd(self, dout, q, k, v, out, lse, causal):
        return attn_bwd(dout, q, k, v, out, lse, causal, backend=self.backend)


def describe(kernels: Kernels, asked: str) -> str:
    """The attention kernels a run uses, and why FA4 is not among them where --attn_backend auto chose otherwise."""
    if asked != "auto" or kernels.backend != "cudnn":
        return kernels.backend
    return f"cudnn ({fa4_unavailable() or f'faster than fa4 at head_dim {kernels.head_dim} on this GPU'})"
