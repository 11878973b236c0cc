"""--fit auto: the memory levers (offloaded and kept blocks, MLP tiles, LoRA's kept MLP outputs) that plan.py
predicts to fit this node, and the check that this node's RAM holds what is offloaded to it.

    torchrun --standalone --nproc_per_node 8 train.py --fit auto     # the default: the plan is printed
    python train.py --config demo --max_steps 2 --gpu_mem_gib 0.05 --host_mem_gib 100   # on CPU, capacities given
    python -m pytest tests/test_plan.py -q

Levers given on the command line win over the plan.
"""
import dataclasses
import os

import torch
import torch.distributed as dist

from million import config
from million import kernels
from million import lora
from million import plan
from million.survival import SharedError


def levers(cfg, layers: int) -> plan.Levers:
    """The memory levers as counts of blocks (the first ones), from the flags: --offload false and
    --keep_attention false mean none, --offload_layers -1 and --keep_attention_layers -1 mean every block."""
    def count(on, n):
        return 0 if not on else layers if n < 0 else min(n, layers)
    return plan.Levers(count(cfg.offload, cfg.offload_layers), count(cfg.keep_attention, cfg.keep_attention_layers),
                       cfg.tiled_mlp, cfg.mlp_tile, count(True, cfg.keep_mlp_layers), cfg.deltanet_tile)


def plan_shape(cfg, mcfg, world: int) -> plan.Shape:
    """The run's shape as plan.py models it (this node's ranks: torchrun's LOCAL_WORLD_SIZE)."""
    backend = kernels.resolve_backend(cfg.attn_backend, mcfg.head_dim, config.packs_documents(cfg))
    deltanet = ""
    if getattr(mcfg, "layer_types", None):  # Qwen3.5: on fla's kernels, memory outside the allocator (plan.py)
        from million.deltanet import resolve_kernel
        deltanet = resolve_kernel(cfg.deltanet_kernel)
    return plan.Shape.of(mcfg, cfg.seq_len, config.context_parallel(cfg, world), world,
                         int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                         param_bytes=getattr(torch, cfg.param_dtype).itemsize,
                         act_bytes=getattr(torch, cfg.dtype).itemsize, loss_chunk=cfg.loss_chunk, attn_backend=backend,
                         stochastic_rounding=cfg.stochastic_rounding, lora_rank=cfg.lora_rank,
                         lora_targets=lora.parse_targets(cfg.lora_targets), quantize=cfg.quantize,
                         deltanet_kernel=deltanet)


def plan_levers(cfg, mcfg, world: int, given: set, device, log):
    """--fit auto: set the levers the command line did not, to the plan predicted to fit this node (plan.py);
    where fp32 state cannot fit, bf16 state with stochastic rounding. Every rank computes the same plan: the
    capacities are the smallest any rank sees. On a CPU, under --fit off too, the RAM is checked first."""
    lv = levers(cfg, mcfg.num_hidden_layers)
    fixed = {}  # what the user said wins
    if given & {"offload", "offload_layers"}:
        fixed["offload_layers"] = lv.offload_layers
    if given & {"keep_attention", "keep_attention_layers"}:
        fixed["keep_attention_layers"] = lv.keep_attention_layers
    if given & {"tiled_mlp", "mlp_tile"}:
        fixed.update(tiled_mlp=cfg.tiled_mlp, mlp_tile=cfg.mlp_tile)
    if "keep_mlp_layers" in given:
        fixed["keep_mlp_layers"] = lv.keep_mlp_layers
    if "deltanet_tile" in given:
        fixed["deltanet_tile"] = lv.deltanet_tile
    if cfg.device == "cpu":
        check_cpu_memory(cfg, mcfg, world, device)
    if cfg.fit == "off" or not cfg.recompute or (cfg.device == "cpu" and not cfg.gpu_mem_gib):
        why = "--fit off" if cfg.fit == "off" else "no recompute" if not cfg.recompute else "CPU"
        return log(f"fit: levers as given ({why})")
    caps = torch.tensor([cfg.gpu_mem_gib or plan.gpu_memory_gib(), cfg.host_mem_gib or plan.host_memory_gib()],
                        dtype=torch.float64, device=device)
    dist.all_reduce(caps, op=dist.ReduceOp.MIN)
    shape = plan_shape(cfg, mcfg, world)
    try:
        lv, cost = plan.choose(shape, caps[0].item(), caps[1].item(), fixed)
    except plan.NoFit as e:
        # fp32 state does not fit but bf16 might: bf16 weights and moments with stochastic rounding (optim.py),
        # unless the command line chose the dtype or the rounding
        if cfg.param_dtype != "float32" or given & {"param_dtype", "stochastic_rounding"} or cfg.lora_rank:
            raise SharedError(f"error: --fit auto: {e}") from None
        shape = dataclasses.replace(shape, param_bytes=2, stochastic_rounding=True)
        try:
            lv, cost = plan.choose(shape, caps[0].item(), caps[1].item(), fixed)
        except plan.NoFit as e2:
            raise SharedError(f"error: --fit auto: {e2}") from None
        cfg.param_dtype, cfg.stochastic_rounding = "bfloat16", True
        log("fit: fp32 weights and AdamW states do not fit; bf16 ones with stochastic rounding do "
            "(--param_dtype bfloat16 --stochastic_rounding true)")
    cfg.offload, cfg.offload_layers = lv.offload_layers > 0, lv.offload_layers
    cfg.keep_attention, cfg.keep_attention_layers = lv.keep_attention_layers > 0, lv.keep_attention_layers
    cfg.tiled_mlp, cfg.mlp_tile, cfg.keep_mlp_layers = lv.tiled_mlp, lv.mlp_tile, lv.keep_mlp_layers
    cfg.deltanet_tile = lv.deltanet_tile
    outside = f" ({shape.outside_bytes / 2**30:.1f} of it for fla's kernels, outside PyTorch's allocator)" \
        if shape.outside_bytes else ""
    log(f"fit: {caps[0].item():.1f} GiB GPU per rank{outside}, {caps[1].item():.0f} GiB host per node -> "
        + plan.describe(lv, cost, shape) + (f" (given: {', '.join(sorted(fixed))})" if fixed else ""))


def cpu_ram_bytes(cfg, mcfg, world: int) -> tuple[float, float]:
    """On a CPU the model's memory is the host's: (bytes a rank needs at its peak, plan.py's with the levers as
    given; the bytes of rank 0's full copy of the weights while it loads them). This node's need is the ranks'
    peaks plus the copy: within -1% to +6% of the peaks measured on a CPU (tests/test_plan.py)."""
    shape, lv = plan_shape(cfg, mcfg, world), levers(cfg, mcfg.num_hidden_layers)
    load = shape.params * (shape.act_bytes if shape.lora_rank else shape.param_bytes)
    return plan.gpu_bytes(shape, lv) + plan.host_bytes(shape, lv, pinned=False), load


def check_cpu_memory(cfg, mcfg, world: int, device):
    """Stop a CPU run before its model is built when this node's ranks would need more RAM than it has, rather than
    let the OS kill it without a word (one line, from rank 0)."""
    per_rank, load = cpu_ram_bytes(cfg, mcfg, world)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    need = (ranks * per_rank + load) / 2**30
    ram = torch.tensor([cfg.host_mem_gib or plan.host_memory_gib()], dtype=torch.float64, device=device)
    dist.all_reduce(ram, op=dist.ReduceOp.MIN)
    if need > ram.item():
        hint = "" if cfg.lora_rank else "use LoRA (--lora_rank 16), "
        raise SharedError(f"error: on the CPU this run needs about {need:.0f} GiB of RAM on this node ({ranks} "
                          f"rank(s) x {per_rank / 2**30:.1f} GiB, and {load / 2**30:.1f} GiB of weights while rank 0 "
                          f"loads them) but it has {ram.item():.0f} GiB; {hint}a shorter --seq_len, a smaller "
                          "--model, or GPUs (--device cuda)")


def check_host_memory(cfg, mcfg, world: int, log):
    """Pinned host memory for offloaded tensors: say how much, and stop before the first step if this machine
    cannot hold it for all of its ranks (pinned pages cannot be swapped out)."""
    shape = plan_shape(cfg, mcfg, world)
    per_rank = plan.host_bytes(shape, levers(cfg, mcfg.num_hidden_layers))
    local, total = shape.ranks_per_node, (cfg.host_mem_gib or plan.host_memory_gib()) * 2**30
    log(f"offload: {per_rank / 2**30:.1f} GiB of pinned host memory per rank, {local * per_rank / 2**30:.1f} GiB for "
        f"the {local} rank(s) of this node ({total / 2**30:.0f} GiB RAM)")
    if local * per_rank > plan.HOST_MARGIN * total:  # the rest for the OS, page cache, the processes' own memory
        raise SystemExit(f"error: offloading needs {local * per_rank / 2**30:.0f} GiB of host RAM on this node but "
                         f"it has {total / 2**30:.0f} GiB; use --fit auto, --offload_layers N (fewer blocks "
                         "offloaded), --keep_attention_layers N, more context parallelism (--cp), or --offload false")


def step_flops(cfg, mcfg, world: int) -> tuple[float, float]:
    """Useful FLOPs of one optimizer step over all ranks (plan.useful_flops), as (matmuls, causal attention): a
    window of packed documents scales the second by its share of the causal triangle. For the MFU train.py logs."""
    shape = plan_shape(cfg, mcfg, world)
    steps = cfg.grad_accum * (world // config.context_parallel(cfg, world))
    attention = 3 * plan.attention_fwd_flops(shape) * steps
    return plan.useful_flops(shape) * steps - attention, attention
