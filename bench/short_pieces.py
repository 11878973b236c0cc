"""Which attention kernels survive very short pieces (a one-token document, a document's last token in a chunk):
each backend's forward and backward on sliced bf16 inputs of Tq = Tk = n, causal, each length in its own process
(a kernel that crashes takes only its process down). Writes bench/results/short_pieces.json.

    python bench/short_pieces.py
"""
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LENGTHS = (1, 2, 3, 4, 8, 15, 16, 17, 64)  # each in a process of its own: a few seconds apiece


def one(backend: str, n: int):
    from million import kernels
    kernels.CUDNN_MIN_TOKENS = 0  # the raw kernel, no routing of short pieces
    gen = torch.Generator(device="cuda").manual_seed(n)
    q, k, v, dout = (torch.randn(1, 1000, h, 128, generator=gen, device="cuda").bfloat16().transpose(1, 2)
                     for h in (8, 2, 2, 8))
    d = slice(100, 100 + n)  # a piece of a longer window, as the document path slices it
    q, k, v, dout = q[:, :, d], k[:, :, d], v[:, :, d], dout[:, :, d]
    out, lse = kernels.attn_fwd(q, k, v, True, backend)
    dq, dk, dv = kernels.attn_bwd(dout, q, k, v, out, lse, True, backend=backend)
    torch.cuda.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(4, 1),
                                                           v.double().repeat_interleave(4, 1), is_causal=True)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    ok = all(torch.isfinite(x).all() for x in (out, lse, dq, dk, dv)) and err < 1e-2
    print(json.dumps(dict(ok=bool(ok), out_rel_err=err)))


def main():
    from million import kernels
    backends = ["cudnn", "flash"] + ([] if kernels.fa4_unavailable() else ["fa4"])
    rows = []
    for backend in backends:
        for n in LENGTHS:
            p = subprocess.run([sys.executable, __file__, backend, str(n)], capture_output=True, text=True,
                               timeout=120)
            said = p.stdout.strip().splitlines()
            row = dict(backend=backend, n=n, rc=p.returncode)
            if p.returncode == 0 and said:
                row.update(json.loads(said[-1]))
            else:
                row.update(ok=False, error=(p.stderr.strip().splitlines() or ["?"])[-1][:200])
            rows.append(row)
            print(row, flush=True)
    out = os.path.join(ROOT, "bench", "results", "short_pieces.json")
    json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(out, "w"), indent=1)
    if os.environ.get("OUT"):
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(os.path.join(os.environ["OUT"],
                  "short_pieces.json"), "w"), indent=1)
    for b in backends:
        print(b, "fails at n =", [r["n"] for r in rows if r["backend"] == b and not r["ok"]])


if __name__ == "__main__":
    if len(sys.argv) == 3:
        one(sys.argv[1], int(sys.argv[2]))
    else:
        main()
