"""train.py with PyTorch's CUDA allocator capped at CAP_GIB GiB (torch.cuda.set_per_process_memory_fraction). Past
the cap an allocation is refused as when the card is full: the allocator gives its cache back to the driver and
tries again, and only then fails (torch's documented behaviour; the one run so far, the 9B's at 262,144 tokens
under 50 GiB, never reached its cap). So a run that completes under a cap just above its allocated peak does not
need the reserve it builds without one; a run that fails needs it.

    CAP_GIB=50 torchrun --standalone --nproc_per_node 1 bench/capped.py --model ... (train.py's flags)
"""
import os
import sys

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as train.py: read at import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import train  # noqa: E402

if __name__ == "__main__":
    device = int(os.environ.get("LOCAL_RANK", "0"))
    cap = float(os.environ["CAP_GIB"]) * 2**30
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(device).total_memory, device)
    train.main(sys.argv[1:])
