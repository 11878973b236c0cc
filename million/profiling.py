"""--profile_step N: one step traced with torch.profiler (and, on CUDA, the allocator's event history).

    torchrun --standalone --nproc_per_node 2 train.py --config demo --profile_step 2
    python bench/profile_step.py --dir runs/demo/profile     # the summary of a GPU trace
"""
import contextlib
import os

import torch


@contextlib.contextmanager
def profiled(cfg, step: int, rank: int, log):
    """Trace step --profile_step into out_dir/profile/ (a no-op on every other step)."""
    if step != cfg.profile_step:
        yield
        return
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cfg.device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        # 2M events: enough for one Qwen3-8B step at 1M tokens (~1M allocations and frees); each event costs
        # a few hundred bytes of host memory. Python frames only: C++ ones, symbolised at the dump, took more
        # host memory than a 128 GiB host had left beside 73 GiB of pinned buffers (killed at 131k with LoRA)
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    prof = torch.profiler.profile(activities=acts)
    prof.start()
    yield
    prof.stop()
    d = os.path.join(cfg.out_dir, "profile")
    os.makedirs(d, exist_ok=True)
    prof.export_chrome_trace(os.path.join(d, f"trace_rank{rank}.json"))
    if cfg.device == "cuda":
        torch.cuda.memory._dump_snapshot(os.path.join(d, f"memory_rank{rank}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)
    log(f"profile of step {cfg.profile_step} written to {d} (summary: python bench/profile_step.py --dir {d})")
