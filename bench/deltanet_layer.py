"""One Gated DeltaNet layer of Qwen3.5 (million/qwen3_5.py) taken apart and timed, so that the DeltaNet part of a
step (plan.py's deltanet_s_per_mtoken_layer: 1.46 s of the 9B's 21.6 s LoRA step at 131,072 tokens; 4.3 s of
24.4 s before fla took the conv and the rule inputs) has an owner.

    python bench/deltanet_layer.py                         # GPU: the 9B's DeltaNet dims, 131,072 tokens, bf16
    python bench/deltanet_layer.py --small                 # any machine: tiny dims on the CPU, the code paths

Each part runs forward and backward on its own inputs (random, fixed seed), timed with CUDA events (median of
--iters after a warm-up), beside its floor: the bytes it must move at --bandwidth (each input read once, each
output written once, in the dtypes the layer uses) or its FLOPs at --gemm_tflops for the projections. The parts:
the projections (in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, out_proj), the causal conv with its SiLU, the
rule inputs (q, k, v as views of the conv's output; the decay and beta: GatedDeltaNet._rule_inputs), the rule (fla,
which normalises q and k itself, or the torch rule with --kernel torch; and in its context-parallel form, v padded
with dk columns from a state, whose extra cost is what the span summaries cost against an all-to-all), and the
gated norm (GatedDeltaNet._output without out_proj); then the whole layer, whose time less the projections' is
what the cost model calls the DeltaNet term. With fla, two rows for comparison: F.conv1d on a transposed copy (the
torch kernel's conv), and the rule as the layer called it before 2026-12-05 (q and k normalised and repeated to the
value heads outside fla, transposed copies in and out). --only picks parts by name. A step
runs the layer's forward three times over (forward, the recompute's forward, backward at about twice a forward),
so the per-step share is about the forward + backward column plus one forward. Writes --out as JSON after each
row.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
from million import deltanet, plan  # noqa: E402
from million.qwen3_5 import GatedDeltaNet, Qwen3_5Config, ZeroCentredRMSNorm, _gated_norm, _zc_norm  # noqa: E402
from ring_sim import median_seconds  # noqa: E402


def fwd_bwd(fn, *inputs):
    """fn's forward and a backward of a random upstream gradient into inputs that require grad."""
    def run():
        out = fn(*inputs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        outs = [o for o in outs if o is not None and o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq_len", type=int, default=131072)
    ap.add_argument("--kernel", default="auto", choices=deltanet.KERNELS)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s (an H200's device-to-device copy)")
    ap.add_argument("--gemm_tflops", type=float, default=641.3, help="plan.py's fitted GEMM rate")
    ap.add_argument("--small", action="store_true", help="tiny dims, 512 tokens, on the CPU")
    ap.add_argument("--out", default=None, help="default bench/results/deltanet_layer.json (_small.json)")
    ap.add_argument("--only", default="", help="comma-separated words: time only the parts whose names hold one")
    a = ap.parse_args()
    if a.small:
        cfg, a.seq_len, a.iters, a.kernel = Qwen3_5Config.tiny(), 512, 2, "torch"
        device, dtype = torch.device("cpu"), torch.float32
    else:
        cfg, device, dtype = Qwen3_5Config(), torch.device("cuda"), torch.bfloat16
    kernel = deltanet.resolve_kernel(a.kernel)
    mixer = deltanet.DeltaNetMixer(kernel=kernel)
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg).to(device, dtype)
    for p in layer.parameters():
        p.requires_grad_(False)  # LoRA-like: the frozen base; gradients flow to the input only
    with torch.no_grad():
        layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(0.01, 16).log())
        layer.dt_bias.fill_(1.0)
    B, T, H = 1, a.seq_len, cfg.hidden_size
    x = (torch.randn(B, T, H, device=device, dtype=dtype) * 0.5).requires_grad_()
    K, conv_dim = cfg.linear_conv_kernel_dim, cfg.linear_conv_dim
    nk, nv, dk, dv = layer.nk, layer.nv, layer.dk, layer.dv
    e = torch.finfo(dtype).bits // 8
    w = layer.conv1d.weight
    with torch.no_grad():
        qkv = layer.in_proj_qkv(x)
        y = deltanet.causal_conv(F.pad(qkv, (0, 0, K - 1, 0)), w, kernel).to(dtype)
        q, k, v, g, beta = (t.detach() for t in layer._rule_inputs(x, y))
        o = torch.randn(B, T, nv, dv, device=device, dtype=dtype)
    rule_in = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    norm = ZeroCentredRMSNorm(H, cfg.rms_norm_eps).to(device, dtype).requires_grad_(False)
    # what DeltaNetMixer.rule runs on each rank's first segments under cp: the state [0 | I] beside the values
    cp_state = F.pad(torch.eye(dk, device=device).expand(B, nv, dk, dk), (dv, 0)).contiguous()

    def conv(kernel):  # the layer's conv on one device: K - 1 zero rows of history, SiLU inside
        return lambda t: deltanet.causal_conv(F.pad(t, (0, 0, K - 1, 0)), w, kernel)

    def rule_before(q, k, v, g, beta):
        """fla's rule as the layer called it until 2026-12-05: q and k normalised in fp32 and repeated to the
        value heads outside fla, [B, H, T, d] copies transposed in and out around fla's [B, T, H, d]."""
        def heads(t, scale=1.0):
            t = (deltanet.l2norm(t.float()) * scale).to(dtype).repeat_interleave(nv // nk, 2)
            return t.transpose(1, 2).contiguous().transpose(1, 2).contiguous()  # the old layout's two copies
        o, _ = deltanet._fla_kernel()(heads(q, dk ** -0.5), heads(k), v.transpose(1, 2).contiguous().transpose(1, 2)
                                      .contiguous(), g.float(), beta, scale=1.0, output_final_state=False)
        return o.transpose(1, 2).contiguous()

    if kernel == "fla":
        with torch.no_grad():  # the comparison row computes what the layer computes
            torch.testing.assert_close(rule_before(q, k, v, g, beta).transpose(1, 2),
                                       mixer.span_rule(q, k, v, g, beta, final=False)[0], atol=2e-2, rtol=2e-2)
    parts = {
        # name: (forward, inputs, floor in seconds for forward + backward)
        # forward 2 T P FLOPs, backward the same (dX only: the base is frozen, as under LoRA)
        "projections": (lambda x, y: (layer.in_proj_qkv(x), layer.in_proj_z(x), layer.in_proj_a(x),
                                      layer.in_proj_b(x), layer.out_proj(y)),
                        [x, o.reshape(B, T, nv * dv).clone().requires_grad_()],
                        2 * 2 * T * layer_params(layer) / (a.gemm_tflops * 1e12)),
        # forward: read, write; backward: read dy and x, write dx (the SiLU recomputed inside)
        f"conv and SiLU ({kernel})": (conv(kernel), [qkv.detach().requires_grad_()],
                                      3 * 2 * T * conv_dim * e / a.bandwidth),
        "rule inputs (q, k, v as views; g, beta from a, b)": (
            lambda x, y: layer._rule_inputs(x, y), [x, y.detach().requires_grad_()], 3 * T * nv * 4 * 4 / a.bandwidth),
        f"rule ({kernel}; q and k normalised inside)": (
            lambda *t: mixer.span_rule(*t, final=False)[0], rule_in,
            3 * T * (2 * nk * dk + 2 * nv * dv) * e / a.bandwidth),
        f"rule ({kernel}), cp form: v padded by dk columns, from a state": (
            lambda *t: mixer.span_rule(*t[:2], F.pad(t[2], (0, dk)), *t[3:], cp_state)[0], rule_in,
            3 * T * (2 * nk * dk + 2 * nv * (dv + dk)) * e / a.bandwidth),
        "gated norm": (lambda o, x: layer.norm(o, layer.in_proj_z(x).view(B, T, nv, dv)),
                       [o.requires_grad_(), x], 3 * 3 * T * nv * dv * e / a.bandwidth),
        "the whole layer": (lambda x: layer(x, mixer), [x], None),
        "gated norm, eager autograd (before)": (
            lambda o, x: _gated_norm(o, layer.in_proj_z(x).view(B, T, nv, dv), layer.norm.weight,
                                     layer.norm.eps)[0], [o, x], 3 * 3 * T * nv * dv * e / a.bandwidth),
        "zero-centred norm [T, hidden]": (lambda x: norm(x), [x], 3 * 2 * T * H * e / a.bandwidth),
        "zero-centred norm, eager autograd (before)": (lambda x: _zc_norm(x, norm.weight, norm.eps)[0], [x],
                                                        3 * 2 * T * H * e / a.bandwidth),
    }
    if kernel == "fla":
        parts["conv and SiLU, F.conv1d on a transposed copy (the torch kernel's)"] = (
            conv("torch"), [qkv.detach().requires_grad_()], 3 * 2 * T * conv_dim * e / a.bandwidth)
        parts["rule, q and k normalised and repeated outside fla (before)"] = (
            rule_before, rule_in, 3 * T * (4 * nv * dk + 2 * nv * dv) * e / a.bandwidth)
    rows = []
    for name, (fn, inputs, floor) in parts.items():
        if not chosen(a, name):
            continue
        with torch.no_grad():
            fwd = median_seconds(lambda: fn(*inputs), device, a.iters, 1)
        both = median_seconds(fwd_bwd(fn, *inputs), device, a.iters, 1)
        rows.append(dict(part=name, fwd_ms=round(fwd * 1e3, 2), fwd_bwd_ms=round(both * 1e3, 2),
                         floor_ms=None if floor is None else round(floor * 1e3, 2)))
        print(json.dumps(rows[-1]), flush=True)
        write(a, device, T, kernel, dtype, rows)  # after each row: a run cut short keeps what it measured
    step = {r["part"]: r["fwd_bwd_ms"] + r["fwd_ms"] for r in rows}
    print(f"\n{'part':48} {'fwd ms':>9} {'fwd+bwd ms':>11} {'floor ms':>9}")
    for r in rows:
        floor = float("nan") if r["floor_ms"] is None else r["floor_ms"]
        print(f"{r['part']:48} {r['fwd_ms']:9.2f} {r['fwd_bwd_ms']:11.2f} {floor:9.2f}")
    n = cfg.layer_types.count("linear_attention")
    if "the whole layer" not in step or "projections" not in step:
        return print(f"wrote {write(a, device, T, kernel, dtype, rows)}")
    whole, proj = step["the whole layer"], step["projections"]
    print(f"a step's share per layer (fwd + bwd + one more fwd), less the projections: {whole - proj:.1f} ms; x {n} "
          f"layers: {(whole - proj) * n / 1e3:.2f} s (the cost model's DeltaNet term at this length: "
          f"{plan.FITTED.deltanet_s_per_mtoken_layer * n * T / 1e6:.2f} s)")
    print(f"wrote {write(a, device, T, kernel, dtype, rows)}")


def chosen(a, name) -> bool:
    """Whether --only selects the part called name."""
    return not a.only or any(word in name for word in a.only.split(","))


def write(a, device, T, kernel, dtype, rows) -> str:
    out = a.out or os.path.join(ROOT, "bench", "results", f"deltanet_layer{'_small' if a.small else ''}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as fh:
        json.dump(dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", seq_len=T,
                       kernel=kernel, dtype=str(dtype), rows=rows), fh, indent=1)
    return out


def layer_params(layer) -> int:
    """The projections' weights: what multiplies each token."""
    return sum(m.weight.numel() for m in (layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_a, layer.in_proj_b,
                                          layer.out_proj))


if __name__ == "__main__":
    main()
