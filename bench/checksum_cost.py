"""What checkpoint checksums cost: CRC-32 (zlib, as checkpoint.py computes it) per GB on this CPU, in memory and
read back from a file just written, against blake2b and sha256; then the estimate for a Qwen3-8B checkpoint from
the bytes the trainer saves (checkpoint.state_bytes of the model as Qwen3 builds it from bench/configs/qwen3-8b,
with AdamW's two moments and step), with fp32 and with bf16 state.

    python bench/checksum_cost.py                      # a 1 GiB file in /tmp, about 20 s
    python bench/checksum_cost.py --gib 4 --dir /data  # the disk that will hold the checkpoints

Prints a table and writes bench/results/checksum_cost.json.
"""
import argparse
import hashlib
import json
import os
import sys
import time
import zlib

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from million import checkpoint  # noqa: E402
from million import hf  # noqa: E402
from model import Qwen3  # noqa: E402


def rate(fn, nbytes: int, repeat=3) -> float:
    """GB/s of fn(), the best of `repeat` runs."""
    best = min(_timed(fn) for _ in range(repeat))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def qwen3_8b_state(param_dtype) -> dict:
    """The state save() is given for Qwen3-8B, as meta tensors: weights and AdamW's moments in param_dtype, a
    float32 step per parameter."""
    with torch.device("meta"):
        model = Qwen3(hf.read_config(os.path.join(ROOT, "bench/configs/qwen3-8b"))).to(param_dtype)
    params = dict(model.named_parameters())
    optim = {n: {"step": torch.zeros((), device="meta"), "exp_avg": torch.empty_like(p),
                 "exp_avg_sq": torch.empty_like(p)} for n, p in params.items()}
    return {"model": params, "optim": {"state": optim}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--ranks", type=int, default=8, help="ranks that share the hashing of one checkpoint")
    a = ap.parse_args()
    buf = os.urandom(256 * 2**20)
    res = {"cpu": next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")),
                       "?"), "cores": os.cpu_count()}
    res["crc32_mem_gbs"] = rate(lambda: zlib.crc32(buf), len(buf))
    res["blake2b_mem_gbs"] = rate(lambda: hashlib.blake2b(buf).digest(), len(buf))
    res["sha256_mem_gbs"] = rate(lambda: hashlib.sha256(buf).digest(), len(buf))

    path, n = os.path.join(a.dir, "checksum_cost.bin"), max(1, int(a.gib * 2**30) // len(buf))  # >= 256 MiB
    t = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(n):
            fh.write(buf)
        fh.flush()
        os.fsync(fh.fileno())
    size = n * len(buf)
    res["write_fsync_gbs"] = size / (time.perf_counter() - t) / 1e9
    try:
        for threads in (1, checkpoint.THREADS):  # the file is in the page cache: as save() reads it back
            checkpoint.THREADS = threads
            res[f"crc32_file_{threads}_threads_gbs"] = rate(lambda: checkpoint.checksums(path), size)
    finally:
        os.remove(path)

    per_rank = res[f"crc32_file_{checkpoint.THREADS}_threads_gbs"] * 1e9
    for dtype in (torch.float32, torch.bfloat16):
        nbytes = checkpoint.state_bytes(qwen3_8b_state(dtype), a.ranks)
        res[f"qwen3_8b_{dtype}".replace("torch.", "")] = dict(
            checkpoint_gb=nbytes / 1e9, hash_one_rank_s=nbytes / per_rank,
            hash_per_rank_s=nbytes / a.ranks / per_rank)
    print(f"{res['cpu']}, {res['cores']} cores")
    print(f"in memory, GB/s: crc32 {res['crc32_mem_gbs']:.2f}, blake2b {res['blake2b_mem_gbs']:.2f}, "
          f"sha256 {res['sha256_mem_gbs']:.2f}")
    print(f"a {size / 2**30:.1f} GiB file: written and fsynced {res['write_fsync_gbs']:.2f} GB/s; read back and "
          f"hashed (checkpoint.checksums) " + ", ".join(f"{res[k]:.2f} GB/s with {k.split('_')[2]} thread(s)"
                                                     for k in res if k.startswith("crc32_file")))
    print(f"s per GB, one rank: {1e9 / per_rank:.2f}")
    for k in ("qwen3_8b_float32", "qwen3_8b_bfloat16"):
        r = res[k]
        print(f"{k}: checkpoint {r['checkpoint_gb']:.1f} GB; hashing it {r['hash_one_rank_s']:.0f} s on one rank, "
              f"{r['hash_per_rank_s']:.1f} s with the files dealt to {a.ranks} ranks")
    os.makedirs(os.path.join(ROOT, "bench/results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench/results/checksum_cost.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
