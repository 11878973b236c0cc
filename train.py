"""Fine-tune Qwen3 on single sequences of a million tokens: FSDP2 over all ranks, ring attention over the
ranks of a context-parallel group, data parallel over the rest.

    torchrun --standalone --nproc_per_node 2 train.py --config demo     # CPU, gloo, tiny Qwen3, ~1 minute
    torchrun --standalone --nproc_per_node 8 train.py                   # Qwen3-8B, 1,048,576 tokens a step

Every field of TrainConfig is a flag (`--key value`, booleans take true/false). The resolved config is printed
and saved in --out_dir; each step appends a line to --out_dir/metrics.jsonl.
"""
import dataclasses
import json
import math
import os
import resource
import shutil
import socket
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TrainConfig:
    config: str = "qwen3-8b-1m"  # the preset these values started from
    # model: a folder or hub id with config.json (+ *.safetensors: weights; without: random init), or "tiny"
    model: str = "Qwen/Qwen3-8B"
    tokenizer: str = ""           # "" = the model's tokenizer.json; "byte" = bytes + end-of-text
    yarn_factor: float = 32.0     # 0 = keep the checkpoint's RoPE; theta always comes from the checkpoint
    yarn_original_max_position_embeddings: int = 32768
    # data: "pg19" (streamed from the hub), "synthetic", or a local .txt/.jsonl/.parquet file or folder
    data: str = "pg19"
    data_repo: str = ""           # "" = data.py's default PG-19 parquet copy
    data_revision: str = "main"
    data_split: str = "train"
    data_column: str = "text"
    seq_len: int = 1_048_576
    cp: int = 0                   # context-parallel degree; 0 = the world size. Data parallel = world / cp
    grad_accum: int = 1           # sequences per rank group per optimizer step
    max_steps: int = 20
    lr: float = 1e-5
    min_lr_ratio: float = 0.1     # cosine decays to lr * min_lr_ratio at max_steps
    warmup_steps: int = 2
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0        # 0 = no clipping (the norm is still logged)
    seed: int = 0
    device: str = "cuda"          # cuda | cpu
    dtype: str = "bfloat16"       # compute: activations, and the weights as gathered for compute
    param_dtype: str = "float32"  # the sharded weights, their gradients and AdamW states (and --save_dir's files).
                                  # bfloat16 halves their memory, but an AdamW update below bf16's resolution
                                  # (~1/256 of the weight) is lost: at lr 1e-5 most weights would never move
    checkpoint: bool = True       # recompute each block in backward, keeping only its input
    offload: bool = True          # keep those inputs in pinned host memory
    offload_layers: int = 0       # offload only the first N blocks' inputs (0 = all): when host RAM is short
    keep_attention: bool = True   # keep attention's output + lse (offloaded with --offload) instead of
                                  # recomputing attention's forward in backward: -18% at 4B/131k
    tiled_mlp: bool = True        # compute the MLP in sequence tiles of mlp_tile rows
    mlp_tile: int = 16384
    loss_chunk: int = 2048        # rows of the chunked loss (bench/bench_loss.py: 3% slower than 4096, 1.8 GiB less)
    peak_tflops: float = 989.0    # per GPU, dense bf16 (H100/H200 SXM), for MFU
    out_dir: str = "runs/qwen3-8b-1m"
    save_dir: str = ""            # "" = no final save; else an HF-format folder
    ckpt_every: int = 0           # every N steps, a resumable checkpoint in out_dir/checkpoint (0 = never)
    resume: str = ""              # a checkpoint folder to continue from (weights, optimizer, data position, step)
    profile_step: int = 0         # >0: trace this step with torch.profiler (+ CUDA memory history) into
                                  # out_dir/profile/; bench/profile_step.py summarises it. The step runs slower


PRESETS = {
    "qwen3-8b-1m": {},
    # ~45 s on 2 CPU cores with 2 ranks; the loss falls from 5.5 (uniform over 257 bytes) to ~2.4
    "demo": dict(model="tiny", tokenizer="byte", yarn_factor=0.0, data="synthetic", seq_len=4096, max_steps=150,
                 lr=3e-3, warmup_steps=10, weight_decay=0.0, device="cpu", dtype="float32", offload=False,
                 tiled_mlp=False, loss_chunk=512, out_dir="runs/demo"),
}


def parse_args(argv) -> TrainConfig:
    """--config NAME picks a preset; every other --key value overrides one field."""
    if len(argv) % 2:
        raise SystemExit(f"arguments come in --key value pairs; got {argv}")
    pairs = dict(zip(argv[::2], argv[1::2]))
    if any(not k.startswith("--") for k in pairs):
        raise SystemExit(f"arguments come in --key value pairs; got {argv}")
    pairs = {k[2:]: v for k, v in pairs.items()}
    name = pairs.get("config", TrainConfig.config)
    if name not in PRESETS:
        raise SystemExit(f"--config {name}: unknown preset; choose one of {sorted(PRESETS)}")
    cfg = TrainConfig(**{**PRESETS[name], "config": name})
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for key, text in pairs.items():
        if key not in fields:
            raise SystemExit(f"--{key}: unknown flag; the flags are {', '.join('--' + f for f in fields)}")
        kind = type(getattr(cfg, key))
        if kind is bool:
            if text.lower() not in ("true", "false"):
                raise SystemExit(f"--{key} takes true or false, not {text!r}")
            value = text.lower() == "true"
        else:
            try:
                value = kind(text.replace("_", "")) if kind in (int, float) else text
            except ValueError:
                raise SystemExit(f"--{key} takes a {kind.__name__}, not {text!r}") from None
        setattr(cfg, key, value)
    return cfg


def check_config(cfg: TrainConfig, world: int):
    """Everything that can be said about the flags before any work starts (the same on every rank)."""
    def need(ok, msg):
        if not ok:
            raise SystemExit(f"error: {msg}")
    need(cfg.device in ("cuda", "cpu"), f"--device {cfg.device}: use cuda or cpu")
    need(cfg.device == "cpu" or torch.cuda.is_available(), "--device cuda but no GPU is visible; use --device cpu")
    for key in ("dtype", "param_dtype"):
        need(getattr(cfg, key) in ("bfloat16", "float32"), f"--{key} {getattr(cfg, key)}: use bfloat16 or float32")
    need(cfg.cp >= 0, f"--cp {cfg.cp}: must be >= 1 (or 0 for the world size)")
    cp = cfg.cp or world
    need(world % cp == 0, f"--cp {cp} does not divide the world size {world}; data parallel = world / cp")
    need(cfg.seq_len > 0 and cfg.seq_len % (2 * cp) == 0,
         f"--seq_len {cfg.seq_len} must be a positive multiple of 2*cp = {2 * cp} (zigzag sharding cuts the "
         f"sequence into 2*cp equal chunks); e.g. --seq_len {max(2 * cp, cfg.seq_len // (2 * cp) * 2 * cp)}")
    for key in ("grad_accum", "max_steps", "loss_chunk"):
        need(getattr(cfg, key) >= 1, f"--{key} must be >= 1")
    need(cfg.lr > 0 and 0 <= cfg.min_lr_ratio <= 1 and cfg.warmup_steps >= 0, "--lr > 0, 0 <= --min_lr_ratio <= 1, "
         "--warmup_steps >= 0")
    need(cfg.ckpt_every >= 0, "--ckpt_every must be >= 0")
    need(not cfg.resume or os.path.isfile(os.path.join(cfg.resume, "trainer.json")),
         f"--resume {cfg.resume}: not a checkpoint folder (no trainer.json); use out_dir/checkpoint of a run "
         "made with --ckpt_every")
    need(0 <= cfg.profile_step <= cfg.max_steps, f"--profile_step {cfg.profile_step}: 0 (off) or a step in "
         f"1..--max_steps; the first step includes warm-up, so 2 is the usual choice")
    need(cfg.grad_clip >= 0 and cfg.weight_decay >= 0, "--grad_clip and --weight_decay must be >= 0")
    need(not cfg.tiled_mlp or cfg.mlp_tile >= 1, "--mlp_tile must be >= 1 when --tiled_mlp true")
    need(cfg.yarn_factor == 0 or (cfg.yarn_factor >= 1 and cfg.yarn_original_max_position_embeddings >= 1),
         "--yarn_factor must be 0 (off) or >= 1, with --yarn_original_max_position_embeddings >= 1")
    return cp


def on_rank0(fn, group=None):
    """Run fn on rank 0 only and give every rank its result, or its error: the other ranks then stop too
    instead of waiting forever in the next collective."""
    msg = [None, None]
    if dist.get_rank() == 0:
        try:
            msg[0] = fn()
        except Exception as e:  # reported on every rank below
            msg[1] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(msg, src=0, group=group)
    if msg[1] is not None:
        raise SystemExit(f"error (on rank 0): {msg[1]}")
    return msg[0]


def all_ok(ok: bool, what: str, device):
    """A collective check that every rank succeeded at `what`; all ranks stop together if one did not."""
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item() < 1:
        where = "on this rank" if not ok else "on another rank"
        raise SystemExit(f"error: {what} failed {where} (see the message above); stopping")


def init_distributed(device: str):
    """torchrun sets RANK/WORLD_SIZE; a plain `python train.py` runs as a world of one."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def build_model(cfg: TrainConfig, mesh, attn_fn, dtype, device):
    """Meta-device model -> FSDP2 shards -> weights read (or drawn) once on rank 0 and broadcast."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from model import Qwen3, Qwen3Config, load_hf_state_dict, resolve_checkpoint
    from parallel import shard_model
    path = None if cfg.model == "tiny" else on_rank0(lambda: resolve_checkpoint(cfg.model))  # downloads once
    if path is not None and not os.path.isdir(path):  # another node without rank 0's disk: its own copy
        path = resolve_checkpoint(cfg.model)
    mcfg = Qwen3Config.tiny() if path is None else Qwen3Config.from_pretrained(path)
    if cfg.yarn_factor:
        mcfg.with_yarn(cfg.yarn_factor, cfg.yarn_original_max_position_embeddings)
    pdtype = getattr(torch, cfg.param_dtype)
    with torch.device("meta"):
        model = Qwen3(mcfg, attn_fn).to(pdtype)
    names = list(model.state_dict())  # before sharding: reading an FSDP module's state dict is collective
    model.set_levers(checkpoint=cfg.checkpoint, offload=cfg.offload, mlp_tile=cfg.mlp_tile if cfg.tiled_mlp else 0,
                     offload_layers=cfg.offload_layers, keep_attention=cfg.keep_attention)
    shard_model(model, mesh, param_dtype=dtype)  # FSDP2 gathers the pdtype shards as dtype for compute
    model.to_empty(device=device)

    def full_state_dict():
        sd = load_hf_state_dict(path, names, pdtype) if path else None
        if sd is None:  # same draw for any world size: the cp-equivalence of runs depends on it
            if path:
                warnings.warn(f"{path} has no *.safetensors: training from random initialisation")
            with torch.device(device):
                ref = Qwen3(mcfg).to(pdtype)
            ref.init_weights(torch.Generator(device).manual_seed(cfg.seed))
            sd = ref.state_dict()
        return sd
    held = {}  # rank 0 keeps the full weights; only the error, if any, is shared
    on_rank0(lambda: held.update(sd=full_state_dict()))
    set_model_state_dict(model, held.get("sd", {}),
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model, mcfg, path


def check_host_memory(cfg, mcfg, cp, dtype, log):
    """Pinned host memory for offloaded block inputs: say how much, and stop before the first step if this
    machine cannot hold it for all of its ranks (pinned pages cannot be swapped out)."""
    layers = min(cfg.offload_layers or mcfg.num_hidden_layers, mcfg.num_hidden_layers)
    per_token = mcfg.hidden_size * dtype.itemsize  # the block input
    if cfg.keep_attention:  # + the attention output and its fp32 log-sum-exp
        per_token += mcfg.num_attention_heads * (mcfg.head_dim * dtype.itemsize + 4)
    per_rank = layers * cfg.seq_len // cp * per_token
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    log(f"offload: {layers} blocks' kept tensors, {per_rank / 2**30:.1f} GiB of pinned host memory per rank, "
        f"{local * per_rank / 2**30:.1f} GiB for the {local} rank(s) of this node ({total / 2**30:.0f} GiB RAM)")
    if local * per_rank > 0.9 * total:
        raise SystemExit(f"error: offloading needs {local * per_rank / 2**30:.0f} GiB of host RAM on this node but "
                         f"it has {total / 2**30:.0f} GiB; use --offload_layers N (fewer blocks offloaded), more "
                         "context parallelism (--cp), or --offload false")


def init_optimizer_state(opt):
    """Allocate AdamW's states now rather than in the first step: one step with zero gradients at lr 0 (which
    changes no weight), then its step count rewound. The first step's peak memory is then the run's, and a
    run that does not fit stops in step 1, not in step 2."""
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    for state in opt.state.values():
        state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine down to lr * min_lr_ratio at max_steps (steps from 1)."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(cfg.warmup_steps, 1)
    t = (step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def step_flops(mcfg, seq_len: int) -> float:
    """Useful FLOPs of one sequence, forward + backward (the recompute is not counted, as MFU usually is not):
    6 per parameter per token for the matmuls, plus causal attention: QK^T and PV, half the square, x3."""
    h, i, L = mcfg.hidden_size, mcfg.intermediate_size, mcfg.num_hidden_layers
    qd, kvd = mcfg.num_attention_heads * mcfg.head_dim, mcfg.num_key_value_heads * mcfg.head_dim
    matmul_params = L * (h * qd * 2 + h * kvd * 2 + 3 * h * i) + h * mcfg.vocab_size
    attention = L * 3 * 2 * 2 * qd * seq_len * seq_len / 2
    return 6 * matmul_params * seq_len + attention


def save_checkpoint(path, model, opt, step, data_state):
    """A resumable checkpoint: model and optimizer shards (torch.distributed.checkpoint, each rank writes its
    own), the step and the data position. Written beside the old one, then swapped in, so a crash while
    saving leaves the previous checkpoint whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(model, opt)
    tmp, old = path + ".tmp", path + ".old"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    if dist.get_rank() == 0:  # rank 0 reads the first data-parallel group's data: the same position as all
        with open(os.path.join(tmp, "trainer.json"), "w") as fh:
            json.dump({"step": step, "data": data_state}, fh)
        if os.path.isdir(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load_checkpoint(path, model, opt):
    """Restores what save_checkpoint wrote (any world size: the shards are resharded); -> (step, data state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, opt)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    with open(os.path.join(path, "trainer.json")) as fh:
        meta = json.load(fh)
    return meta["step"], meta["data"]


def offload_bytes(model) -> int:
    return model.layers[0].offload.host_bytes() if model.layers[0].offload is not None else 0


def profile_begin(cfg: TrainConfig):
    """Start torch.profiler (and, on CUDA, the allocator's event history) for one step."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cfg.device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    prof = torch.profiler.profile(activities=acts)
    prof.start()
    return prof


def profile_end(prof, cfg: TrainConfig, rank: int, log):
    prof.stop()
    d = os.path.join(cfg.out_dir, "profile")
    os.makedirs(d, exist_ok=True)
    prof.export_chrome_trace(os.path.join(d, f"trace_rank{rank}.json"))
    if cfg.device == "cuda":
        torch.cuda.memory._dump_snapshot(os.path.join(d, f"memory_rank{rank}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)
    log(f"profile of step {cfg.profile_step} written to {d} (summary: python bench/profile_step.py --dir {d})")


def main(argv):
    t_start = time.time()
    cfg = parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before the first allocation
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    cp = check_config(cfg, world_env)
    rank, world = init_distributed(cfg.device)
    try:
        train(cfg, cp, rank, world, t_start)
    except (ValueError, OSError) as e:  # bad input found after start-up (model files, data): no traceback
        raise SystemExit(f"error (rank {rank}): {type(e).__name__}: {e}") from None
    except torch.OutOfMemoryError as e:
        raise SystemExit(f"error (rank {rank}): out of GPU memory at --seq_len {cfg.seq_len} with --cp {cp} "
                         f"({str(e).splitlines()[0]}). Less memory per GPU: a larger --cp (more GPUs per "
                         "sequence), --offload true, --tiled_mlp true with a smaller --mlp_tile, a smaller "
                         "--loss_chunk, or a shorter --seq_len") from None
    finally:
        dist.destroy_process_group()


def train(cfg: TrainConfig, cp: int, rank: int, world: int, t_start: float):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    import data
    from model import save_hf_checkpoint
    from parallel import RingAttention, clip_grad_norm_, zigzag_positions, zigzag_shard

    dp = world // cp
    dp_rank, cp_rank = divmod(rank, cp)  # a context-parallel group is cp consecutive ranks: one node when it fits
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, cfg.dtype)
    log = print if rank == 0 else (lambda *a, **k: None)
    log(f"config: {json.dumps(dataclasses.asdict(cfg))}")
    log(f"world {world} = data parallel {dp} x context parallel {cp}; {cfg.seq_len // cp:,} tokens per rank")
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "train_config.json"), "w") as fh:
            json.dump(dataclasses.asdict(cfg), fh, indent=2)
    torch.manual_seed(cfg.seed)

    mesh = init_device_mesh(cfg.device, (dp, cp), mesh_dim_names=("dp", "cp"))
    cp_group = mesh.get_group("cp")
    fsdp_mesh = init_device_mesh(cfg.device, (world,))
    model, mcfg, path = build_model(cfg, fsdp_mesh, RingAttention(cp_group), dtype, device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {mcfg.num_hidden_layers} layers, hidden {mcfg.hidden_size}, {n_params / 1e9:.3f} B parameters, "
        f"rope_scaling {mcfg.rope_scaling}")
    if cfg.offload:
        check_host_memory(cfg, mcfg, cp, dtype, log)
    if cfg.param_dtype == "bfloat16":
        log("warning: --param_dtype bfloat16 keeps weights and AdamW states in bf16: an update smaller than about "
            "1/256 of a weight rounds away (at lr 1e-5, 98% of weights do not move). Use float32 unless you are "
            "matching a bf16 recipe (as bench/ does, for the single-GPU reference)")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            weight_decay=cfg.weight_decay, fused=cfg.device == "cuda")
    init_optimizer_state(opt)

    # Data: made once per context-parallel group (on its first rank) and broadcast to the rest of the group.
    loader = None
    if cp_rank == 0:
        tok_spec = cfg.tokenizer or path or ""
        try:
            tok = data.load_tokenizer(tok_spec)
            if tok.vocab_size > mcfg.vocab_size:
                raise ValueError(f"tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
                                 f"{mcfg.vocab_size}; use the model's own tokenizer")
            kw = dict(seed=cfg.seed, revision=cfg.data_revision, split=cfg.data_split, text_column=cfg.data_column)
            if cfg.data_repo:
                kw["repo"] = cfg.data_repo
            books = lambda start_book: data.iter_books(cfg.data, start_book=start_book, **kw)  # noqa: E731
            loader = data.WindowLoader(books, tok, cfg.seq_len, dp_rank=dp_rank, dp_size=dp)
        except (OSError, ValueError, RuntimeError) as e:
            print(f"error (rank {rank}): data: {e}", file=sys.stderr)
    all_ok(cp_rank != 0 or loader is not None, "setting up the data", device)
    src = dist.get_global_rank(cp_group, 0)

    def next_window():
        w, ok = torch.empty(cfg.seq_len + 1, dtype=torch.long), True
        if loader is not None:
            try:
                w = next(loader)
            except StopIteration:
                print(f"error (rank {rank}): the data ran out; use more data or fewer --max_steps", file=sys.stderr)
                ok = False
            except Exception as e:  # every rank must hear of it, or the others hang in the next collective
                print(f"error (rank {rank}): reading data: {type(e).__name__}: {e}", file=sys.stderr)
                ok = False
        all_ok(ok, "reading data", device)
        w = w.to(device)
        dist.broadcast(w, src=src, group=cp_group)
        return w

    first = 1
    if cfg.resume:
        done, data_state = load_checkpoint(cfg.resume, model, opt)
        if loader is not None:
            loader.load_state_dict(data_state)
        first = done + 1
        log(f"resumed from {cfg.resume} after step {done}")
    positions = zigzag_positions(cfg.seq_len, cp_rank, cp, device=device)[None]  # (1, T/cp)
    flops = step_flops(mcfg, cfg.seq_len) * cfg.grad_accum * dp
    metrics = open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a" if cfg.resume else "w") if rank == 0 else None
    model.train()
    for step in range(first, cfg.max_steps + 1):
        t0 = time.time()
        if cfg.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        prof = profile_begin(cfg) if step == cfg.profile_step else None
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        micro = []
        for _ in range(cfg.grad_accum):
            w = next_window()
            inputs = zigzag_shard(w[:-1], 0, cp_rank, cp)[None]   # (1, T/cp)
            labels = zigzag_shard(w[1:], 0, cp_rank, cp)[None]    # shifted on the whole sequence, then sharded
            micro.append((inputs, labels))
        # loss = global sum / global count of target tokens, over ranks and micro-steps alike
        count = sum((lab != -100).sum() for _, lab in micro).float()
        dist.all_reduce(count)
        count.clamp_(min=1)  # a step with no target tokens has loss 0, not 0/0
        loss_sum = torch.zeros((), device=device)
        for inputs, labels in micro:
            s, _ = model(inputs, positions, labels, loss_chunk=cfg.loss_chunk)
            (s / count).backward()
            loss_sum += s.detach()
        dist.all_reduce(loss_sum)
        grad_norm = clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = (loss_sum / count).item()  # syncs: the step's time below is real
        if prof is not None:
            profile_end(prof, cfg, rank, log)
        if step == first:
            log(f"time to first step: {time.time() - t_start:.1f} s (start-up, weights, data, first step)")
        dt = time.time() - t0
        peak = torch.tensor([torch.cuda.max_memory_allocated() if cfg.device == "cuda" else  # CPU: max RSS
                             resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64,
                            device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        tokens = cfg.seq_len * cfg.grad_accum * dp
        rec = dict(step=step, loss=loss, grad_norm=grad_norm.item(), num_tokens=tokens, lr=lr, step_time_s=dt,
                   tokens_per_s=tokens / dt,
                   mfu=flops / dt / (world * cfg.peak_tflops * 1e12) if cfg.device == "cuda" else None,
                   peak_mem_gb=peak.item() / 1e9, offload_host_gb=offload_bytes(model) / 1e9)
        if math.isnan(loss) or math.isinf(loss):
            raise SystemExit(f"error: loss is {loss} at step {step}; lower --lr or check the data")
        log(f"step {step:4d} | loss {loss:.4f} | grad norm {rec['grad_norm']:.3f} | lr {lr:.2e} | "
            f"{rec['tokens_per_s']:,.0f} tok/s | " + (f"MFU {rec['mfu']:.1%} | " if rec["mfu"] is not None else "")
            + f"{dt:.2f} s | peak mem {rec['peak_mem_gb']:.1f} GB")
        if metrics:
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
        if cfg.ckpt_every and (step % cfg.ckpt_every == 0 or step == cfg.max_steps):
            save_checkpoint(os.path.join(cfg.out_dir, "checkpoint"), model, opt, step,
                            loader.state_dict() if loader is not None else None)
    if loader is not None:
        loader.close()
    if cfg.save_dir:
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            save_hf_checkpoint(cfg.save_dir, mcfg, sd, max_shard_bytes=5 * 2**30)
            for f in os.listdir(path) if path else []:  # the tokenizer goes with the weights
                if f.startswith("tokenizer") or f in ("vocab.json", "merges.txt", "generation_config.json"):
                    shutil.copy(os.path.join(path, f), cfg.save_dir)
            log(f"saved HF checkpoint to {cfg.save_dir}")
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
