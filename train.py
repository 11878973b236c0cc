"""Fine-tune Qwen3 on single sequences of a million tokens: FSDP2 over all ranks, ring attention over the
ranks of a context-parallel group, data parallel over the rest.

    torchrun --standalone --nproc_per_node 2 train.py --config demo     # CPU, gloo, tiny Qwen3, ~1 minute
    torchrun --standalone --nproc_per_node 8 train.py                   # Qwen3-8B, 1,048,576 tokens a step
    python train.py --help                                              # every flag (config.py)

Every field of config.TrainConfig is a flag (`--key value`, booleans take true/false). The resolved config is
printed and saved in --out_dir; each step appends a line to --out_dir/metrics.jsonl.

A run is its --out_dir. Relaunching the same command after any stop (a crash, kill -9, SIGTERM, a requeue, a
torchrun restart) continues from the newest complete checkpoint (checkpoint.py, rundir.py) with the same losses
as if it had never stopped. SIGTERM, SIGINT, SIGUSR1 and SIGHUP end the run at the next step boundary with a
checkpoint and exit code 75 (survival.EXIT_PREEMPTED). A step whose loss or gradient norm is not finite changes
no weight.

Read top to bottom: the ranks, building (model, optimizer, data), the step, the loop, saving, main. The flags
live in config.py, errors and signals in survival.py, held-out evaluation in evaluate.py.
"""
import dataclasses
import datetime
import functools
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.rendezvous import rendezvous

from million import chat
from million import checkpoint
from million import config
import data
from million import documents
from million import fit
from million import hf
from million import kernels
from million import lora
from million import moe
from million import optim
from million import packing
import parallel
from million import plan
from million import retrieval
from million import rundir
from million.config import TrainConfig
from million.export import all_finite, export_hf
from million.evaluate import PositionSums, eval_due, evaluate, evaluate_only, open_eval_log, peak_memory
from model import Qwen3, Qwen3Config
from million.profiling import profiled
from million.survival import (EXIT_PREEMPTED, QUIET_EXIT_S, Log, SharedError, StopRequest, Watchdog, from_rank0, on_rank0,
                      stop_on_error)


def human_count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.1f} K"


# ---------------------------------------------------------------------------------------------
# Ranks: start-up
# ---------------------------------------------------------------------------------------------

def init_distributed(cfg: TrainConfig):
    """torchrun sets RANK/WORLD_SIZE; a plain `python train.py` runs as a world of one. -> (rank, world, store)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    timeout = datetime.timedelta(minutes=cfg.dist_timeout_min)
    store, rank, world = next(rendezvous("env://", timeout=timeout))
    # torchrun keeps one store across restarts of its workers: a prefix per attempt keeps a restarted worker from
    # reading the addresses its killed predecessor published there (bench/NOTES.md, train.py)
    store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    dist.init_process_group("nccl" if cfg.device == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                            timeout=timeout)
    return rank, world, store


# ---------------------------------------------------------------------------------------------
# Building: the mesh, the model, the optimizer, the data
# ---------------------------------------------------------------------------------------------

@dataclass
class Setup:
    """What training and evaluation share, built by build()."""
    mesh: object             # DeviceMesh (dp, cp): a cp group is cp consecutive ranks; FSDP2 shards over all
    model: torch.nn.Module
    mcfg: Qwen3Config
    model_path: str | None   # the local folder of --model (None for "tiny")
    shapes: dict             # every parameter's full shape (before sharding)
    device: torch.device


def build(cfg: TrainConfig, given: set, cp: int, world: int, device, log) -> Setup:
    """One device mesh, ring attention over its cp groups, the model sharded over every rank and loaded."""
    torch.manual_seed(cfg.seed)
    # A context-parallel group is cp consecutive ranks: one node when it fits
    mesh = init_device_mesh(cfg.device, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    schedule = parallel.zigzag_schedule
    if cfg.packing != "concat":  # windows of documents: the ring computes only the blocks inside them
        schedule = functools.partial(documents.schedule, balanced=cfg.doc_attention == "balanced")
    attn = parallel.RingAttention(mesh.get_group("cp"), kernels.Kernels(cfg.attn_backend), schedule)
    model, mcfg, path, shapes = build_model(cfg, given, mesh, attn, device, log)
    n_params = sum(math.prod(x) for x in shapes.values())
    experts = (f" ({human_count(plan.Shape.of(mcfg, 1, 1, 1, 1).active_params)} active: "
               f"top-{mcfg.num_experts_per_tok} of {mcfg.num_experts} experts"
               + (", load-balancing loss" if mcfg.output_router_logits else "") + ")" if mcfg.num_experts else "")
    backend = attn.kernels.backend
    log(f"model: {mcfg.num_hidden_layers} layers, hidden {mcfg.hidden_size}, {human_count(n_params)} parameters"
        f"{experts}, rope_scaling {mcfg.rope_scaling}; attention kernels: {backend}"
        + (f" ({kernels.fa4_unavailable()})" if cfg.attn_backend == "auto" and backend == "cudnn" else ""))
    if cfg.lora_rank:
        log(lora.describe(model))
    return Setup(mesh, model, mcfg, path, shapes, device)


def model_folder(spec: str) -> str:
    """--model as a local folder (a hub id is downloaded); errors name the flag."""
    try:
        return hf.local_folder(spec)
    except (OSError, ValueError) as e:
        raise type(e)(f"--model {e}") from None


def model_config(cfg: TrainConfig) -> tuple[str | None, Qwen3Config]:
    """--model's local folder (None for "tiny") and its config, with --yarn_factor applied."""
    path = None if cfg.model == "tiny" else model_folder(cfg.model)
    mcfg = Qwen3Config.tiny() if path is None else hf.read_config(path)
    if cfg.yarn_factor:
        mcfg = mcfg.yarn_scaled(cfg.yarn_factor, cfg.yarn_original_max_position_embeddings)
    return path, mcfg


def build_model(cfg: TrainConfig, given: set, mesh, attn_fn, device, log):
    """Meta-device model -> FSDP2 shards -> weights read (or drawn) once on rank 0 and broadcast."""
    # rank 0 downloads and reads the config once, and alone says what is wrong with it
    path, mcfg = from_rank0(on_rank0(lambda: model_config(cfg), device))
    if path is not None and not os.path.isdir(path):  # another node without rank 0's disk: its own copy
        path = model_folder(cfg.model)
    fit.plan_levers(cfg, mcfg, mesh.size(), given, device, log)
    pdtype = getattr(torch, cfg.param_dtype)
    cp_group = mesh.get_group("cp")
    with torch.device("meta"):
        if mcfg.num_experts:  # its load-balancing loss sums the router's counts over the ranks of a sequence
            model = moe.Qwen3MoE(mcfg, attn_fn, cp_sum=lambda t: dist.all_reduce(t, group=cp_group)).to(pdtype)
        else:
            model = Qwen3(mcfg, attn_fn).to(pdtype)
    base_dtype = getattr(torch, cfg.dtype) if cfg.lora_rank else pdtype  # LoRA: the frozen base in --dtype
    if cfg.lora_rank:
        lora.apply(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, base_dtype, cfg.quantize)
    shapes = {n: list(t.shape) for n, t in model.state_dict().items()}  # before sharding (then it is collective)
    lv = fit.levers(cfg, mcfg.num_hidden_layers)
    model.set_levers(recompute=cfg.recompute, offload=lv.offload_layers > 0, offload_layers=lv.offload_layers,
                     keep_attention=lv.keep_attention_layers > 0, keep_attention_layers=lv.keep_attention_layers,
                     mlp_tile=cfg.mlp_tile if cfg.tiled_mlp else 0)
    if cfg.lora_rank:
        lora.keep_mlp(model, lv.keep_mlp_layers)
    # FSDP2 over every rank, gathering the param_dtype shards as --dtype for compute. Its mesh is the world group
    # as it is, not a flattened (dp, cp) mesh: that makes a process group whose teardown at exit can abort a gloo
    # rank (bench/NOTES.md, train.py)
    parallel.shard_model(model, DeviceMesh.from_group(dist.group.WORLD, cfg.device),
                         param_dtype=getattr(torch, cfg.dtype))
    model.to_empty(device=device)
    # rank 0 keeps the full weights; the same random draw for any world size: the cp-equivalence of runs depends on it
    base = [n for n in shapes if not lora.is_adapter(n)]
    sd = on_rank0(lambda: {**hf.load_or_init_state_dict(path, mcfg, base, base_dtype, cfg.seed, device),
                           **lora.adapter_state_dict(shapes, cfg.seed)}, device)
    set_model_state_dict(model, sd or {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    if cfg.quantize:
        lora.quantize(model)
    return model, mcfg, path, shapes


def make_optimizer(cfg: TrainConfig, model) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapters alone
    if cfg.stochastic_rounding:
        opt = optim.AdamWStochastic(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                    weight_decay=cfg.weight_decay, seed=cfg.seed, rank=dist.get_rank())
    else:
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                weight_decay=cfg.weight_decay, fused=cfg.device == "cuda")
    init_optimizer_state(opt)
    return opt


def init_optimizer_state(opt):
    """AdamW's states allocated now rather than in the first step: one step with zero gradients at lr 0 (which
    changes no weight), then its step count rewound. The first step's peak memory is then the run's, and a run
    that does not fit stops in step 1, not in step 2."""
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



def make_batches(cfg: TrainConfig, setup: Setup, source: str, split: str, grad_accum: int) -> data.Batches:
    """This rank's micro-batches of `source` (its `split`): one loader per data-parallel group (data.Batches)."""
    dp, dp_rank = setup.mesh.size(0), setup.mesh.get_local_rank("dp")
    kw = dict(seed=cfg.seed, revision=cfg.data_revision, split=split, text_column=cfg.data_column)
    if cfg.data_repo:
        kw["repo"] = cfg.data_repo
    concat = (cfg.packing if cfg.packing != "auto" else from_rank0(on_rank0(lambda: chat.default_packing(
        source, **{k: v for k, v in kw.items() if k != "seed"}), setup.device))) == "concat"

    def make_loader():
        tok = data.load_tokenizer(data.tokenizer_spec(cfg.tokenizer, setup.model_path))
        if tok.vocab_size > setup.mcfg.vocab_size:
            raise ValueError(f"tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
                             f"{setup.mcfg.vocab_size}; use the model's own tokenizer")
        if concat:  # text laid end to end, as read
            docs = lambda start: data.tokenized(data.iter_books(source, start_book=start, **kw), tok)  # noqa: E731
            return data.WindowLoader(docs, cfg.seq_len, dp_rank=dp_rank, dp_size=dp)
        # each row a document: text, a conversation, a prompt and its completion (chat.py), packed (packing.py)
        template = open(cfg.chat_template, encoding="utf-8").read() if cfg.chat_template else None
        docs = lambda start: chat.iter_documents(  # noqa: E731
            source, tok, start_row=start, chat_template=template, assistant_only_loss=cfg.assistant_only_loss,
            completion_only_loss=cfg.completion_only_loss, **kw)
        return packing.PackedLoader(docs, cfg.seq_len, tok.eos_id, dp_rank=dp_rank, dp_size=dp)
    cp_group = setup.mesh.get_group("cp")
    if concat:
        return data.Batches(make_loader, cfg.seq_len, grad_accum, cp_group, setup.device)
    # each window's chunks go to ranks by its documents' masked area (documents.py), or zigzag with "simple"
    layout_of = functools.partial(documents.cp_layout, cp_group.size(), balanced=cfg.doc_attention == "balanced")
    return packing.PackedBatches(make_loader, cfg.seq_len, grad_accum, cp_group, setup.device, layout_of=layout_of)


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------

def lr_at(step: int, cfg: TrainConfig, anchor=None) -> float:
    """Linear warmup over warmup_steps, then cosine down to lr * min_lr_ratio at max_steps (steps from 1).
    anchor [d, f]: after step d the cosine starts from the fraction f of lr instead (schedule_anchor)."""
    if anchor is not None and step > anchor[0]:
        start, top = anchor
    elif step <= cfg.warmup_steps:
        return cfg.lr * step / max(cfg.warmup_steps, 1)
    else:
        start, top = cfg.warmup_steps, 1.0
    t = min((step - start) / max(cfg.max_steps - start, 1), 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (top - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def step_counts(batch: list[data.Micro], cp_rank: int, device) -> tuple[int, int]:
    """(trained pairs, padding pairs) in this step's windows over every rank: the loss's divisor, counted from the
    labels each step (never a constant of the config: conversations train on part of their tokens)."""
    t = torch.stack([sum((m.labels != -100).sum() for m in batch),
                     torch.tensor(sum(m.pad for m in batch) if cp_rank == 0 else 0, device=device)])
    dist.all_reduce(t)
    return tuple(t.tolist())


def train_step(model, opt, batch: list[data.Micro], n_trained: int, cfg: TrainConfig, lr: float):
    """Forward + backward over the micro-batches, clip, AdamW. -> (loss, grad_norm, applied, loss_by_position,
    aux_loss), where loss is the global mean NLL over the n_trained target tokens of every rank and micro-batch (a
    rank holding none still runs every collective, adding zero), loss_by_position the same mean over each of
    --loss_buckets spans of position, and aux_loss a MoE's load-balancing term on the same scale (None for a dense
    model): the gradient includes it, loss does not. A non-finite loss or grad norm (the same on every rank: both
    are all-reduced), or a step with nothing to train on, skips the update: no weight changes."""
    for g in opt.param_groups:
        g["lr"] = lr
    sums = PositionSums(cfg.seq_len, cfg.loss_buckets, batch[0].labels.device)
    for m in batch:
        out = model(m.inputs, m.positions, m.labels, loss_chunk=cfg.loss_chunk, doc_lens=m.doc_lens)
        (out.total() / max(n_trained, 1)).backward()  # each rank's share of the global mean; FSDP2 sums gradients
        sums.add(out, m)
    loss_sum, aux_sum, by_position = sums.reduce()
    grad_norm = parallel.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    loss = loss_sum / max(n_trained, 1)
    applied = bool(torch.isfinite(loss) & torch.isfinite(grad_norm)) and n_trained > 0
    if applied:
        opt.step()
    opt.zero_grad(set_to_none=True)
    aux = None if aux_sum is None else aux_sum.item() / max(n_trained, 1)
    return loss.item(), grad_norm.item(), applied, by_position, aux


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------

@dataclass
class Run:
    """What the loop works on, built by start_run."""
    setup: Setup
    opt: torch.optim.Optimizer
    batches: data.Batches
    n_pairs: int             # (input, label) pairs per step over all ranks and micro-batches
    flops: tuple             # useful FLOPs per step over all ranks (plan.useful_flops): (matmuls, causal attention)
    fingerprint: dict
    done: int                # steps already trained (from the checkpoint resumed)
    lr_anchor: list | None   # [step, fraction of --lr] where a changed schedule continues from (lr_at)
    launch: dict             # this launch, for out_dir/launches.jsonl
    lock: "rundir.Lock | None"  # rank 0: out_dir is this run's
    metrics: "rundir.JsonlLog | None" = None  # rank 0, opened once the first step has run


def resume_changes(cfg: TrainConfig, saved: dict) -> dict:
    """{flag: [value in the checkpoint's launch, value now]} for the flags that changed; stops on a fixed one
    (config.FIXED_ON_RESUME)."""
    now = dataclasses.asdict(cfg)
    changed = {k: [saved[k], v] for k, v in now.items()
               if k in saved and saved[k] != v and k not in ("config", "resume", "overwrite")}
    fixed = [k for k in changed if k in config.FIXED_ON_RESUME]
    if fixed:
        raise SharedError("error: a resumed run keeps " + ", ".join(f"--{k} {saved[k]} (given: {now[k]})"
                                                                   for k in fixed)
                          + "; use the values it started with, or another --out_dir for a new run")
    return changed


def schedule_anchor(cfg: TrainConfig, saved: dict, anchor, done: int) -> list | None:
    """Where the LR schedule continues from when its shape changed on resume (--max_steps, --warmup_steps or
    --min_lr_ratio): the fraction of --lr the run had reached at step `done`, on the old schedule. Without it,
    a cosine recomputed over a longer run would jump up."""
    keys = ("max_steps", "warmup_steps", "min_lr_ratio")
    if all(saved.get(k) == getattr(cfg, k) for k in keys) or done <= saved.get("warmup_steps", 0):
        return anchor  # unchanged, or still warming up (the cosine has not begun: nothing to jump from)
    old = dataclasses.replace(cfg, **{k: saved[k] for k in (*keys, "lr")})
    return [done, lr_at(done, old, anchor) / old.lr]


def start_run(cfg: TrainConfig, given: set, cp: int, world: int, device, log) -> Run:
    """out_dir taken (rundir.Lock), the setup, the optimizer and the data; then the checkpoint to resume (if any),
    what changed since the last launch, and the output checks. Nothing in out_dir changes until step 1 is done
    but the lock file of a folder that exists and the name of a checkpoint that fails (moved aside)."""
    lock = on_rank0(lambda: rundir.Lock(cfg.out_dir), device)
    try:
        return _start_run(cfg, given, cp, world, device, log, lock)
    except BaseException:
        if lock:
            lock.abandon()
        raise


def _start_run(cfg: TrainConfig, given: set, cp: int, world: int, device, log, lock) -> Run:
    setup = build(cfg, given, cp, world, device, log)
    if cfg.offload:
        fit.check_host_memory(cfg, setup.mcfg, world, log)
    if cfg.param_dtype == "bfloat16" and not cfg.stochastic_rounding:
        log("warning: --param_dtype bfloat16 keeps weights and AdamW states in bf16: an update smaller than about "
            "1/256 of a weight rounds away (at lr 1e-5, 98% of weights do not move). Add --stochastic_rounding "
            "true, or use float32 unless you are matching a bf16 recipe (as bench/ does)")
    opt = make_optimizer(cfg, setup.model)
    batches = make_batches(cfg, setup, cfg.data, cfg.data_split, cfg.grad_accum)
    data_fp = {k: getattr(cfg, k) for k in ("data", "data_repo", "data_revision", "data_split", "data_column",
                                            "seq_len", "seed")}
    fp = rundir.fingerprint(setup.mcfg, setup.shapes, data_fp, data.tokenizer_spec(cfg.tokenizer, setup.model_path))
    candidates = from_rank0(on_rank0(lambda: rundir.resume_candidates(cfg.out_dir, cfg.resume, cfg.overwrite, fp,
                                                                      log), device))
    model_sd, optim_sd = get_state_dict(setup.model, opt, options=checkpoint.STATE)
    state = {"model": model_sd, "optim": optim_sd}
    done, anchor, changes = 0, None, {}
    if candidates:
        t0 = time.time()
        resume_from, meta = rundir.load_newest(candidates, state, device, log, exc=SharedError,
                                               move_aside=cfg.resume == "auto")
        changes = resume_changes(cfg, meta["config"])
        set_state_dict(setup.model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=checkpoint.STATE)
        batches.load_state_dict(meta["data"])
        done = meta["step"]
        anchor = schedule_anchor(cfg, meta["config"], meta.get("lr_anchor"), done)
        log(f"resumed from {resume_from} after step {done} (loaded in {time.time() - t0:.1f} s)")
        if changes:
            log("changed since the launch that saved it: " + "; ".join(f"--{k} {a} -> {b}" for k, (a, b) in
                                                                        changes.items()))
        if anchor != meta.get("lr_anchor") and done < cfg.max_steps:
            log(f"the LR schedule continues at step {done + 1} with {lr_at(done + 1, cfg, anchor):.3g}, on a cosine "
                f"to {cfg.lr * cfg.min_lr_ratio:.3g} at step {cfg.max_steps}, without a jump (to warm up again, "
                "start a new run from an export: --model SAVE_DIR)")
    n_params, pbytes = sum(math.prod(x) for x in setup.shapes.values()), getattr(torch, cfg.param_dtype).itemsize
    n_trained = sum(p.numel() for p in setup.model.parameters() if p.requires_grad)  # LoRA: the adapters
    ckpt_bytes = checkpoint.state_bytes(state, world) if cfg.checkpoints else 0  # with false: writable, no size
    copies = on_rank0(lambda: rundir.checkpoints_to_fit(cfg.out_dir, cfg.keep_checkpoints), device)
    needs = [(cfg.out_dir, "--out_dir", "a checkpoint", ckpt_bytes, copies)]
    if cfg.save_dir:
        exported = n_trained if cfg.lora_rank and not cfg.merge_lora else n_params
        needs.append((cfg.save_dir, "--save_dir", "the exported model", exported * pbytes, 1))
    on_rank0(lambda: rundir.check_outputs(needs), device)
    if cfg.checkpoints:
        log(f"outputs: a checkpoint is about {rundir.human_bytes(ckpt_bytes)}; {cfg.keep_checkpoints} kept")
    dp = world // cp
    launch = dict(started=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                  host=socket.gethostname(), world=world, cp=cp, from_step=done, changes=changes, lr_anchor=anchor)
    shape, steps = fit.plan_shape(cfg, setup.mcfg, world), cfg.grad_accum * dp
    attention = 3 * plan.attention_fwd_flops(shape) * steps
    return Run(setup, opt, batches, cfg.seq_len * steps, (plan.useful_flops(shape) * steps - attention, attention),
               fp, done, anchor, launch, lock)


def train(cfg: TrainConfig, given: set, cp: int, rank: int, world: int, t_start: float, log) -> int:
    log(f"config: {config.summary(cfg)} (every value: {cfg.out_dir}/train_config.json once step 1 is done)")
    log(f"world {world} = data parallel {world // cp} x context parallel {cp}; {cfg.seq_len // cp:,} tokens per rank")
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    if cfg.eval_only:
        return evaluate_only(cfg, given, cp, world, device, log, build, make_batches)
    run = start_run(cfg, given, cp, world, device, log)
    setup = run.setup
    if run.done >= cfg.max_steps:
        log(f"the run in {cfg.out_dir} is complete (step {run.done} of --max_steps {cfg.max_steps}); nothing to do. "
            "Raise --max_steps to train on, or use another --out_dir")
        return 0
    eval_log, first_eval, first_needles = None, None, None
    if run.done == 0 and eval_due(cfg, 0):  # the model as it came, before any step (written once step 1 is done)
        first_eval, first_needles = evaluate(cfg, setup, make_batches, 0, None, log, hold=True)
    stop = StopRequest()  # from here on a signal ends the run with a checkpoint; before, it ends it at once
    last_save, saved, skipped, zero_norm = time.time(), run.done, 0, 0
    t_loop, step_times = time.time(), []
    setup.model.train()
    for step in range(run.done + 1, cfg.max_steps + 1):
        t0 = time.time()
        try:
            batch = run.batches.next()
        except data.DataEnd:
            log(f"the data ran out after step {step - 1}; ending the run there, as at --max_steps")
            if saved < step - 1 and cfg.checkpoints:
                save_checkpoint(cfg, run, step - 1, log)
            break
        except data.DataError as e:  # every rank has it; the steps done so far are kept first
            if saved < step - 1 and cfg.checkpoints:
                save_checkpoint(cfg, run, step - 1, log)
            raise SystemExit(f"{e}; the run stopped before step {step}" + (
                f" with a checkpoint of step {step - 1}" if cfg.checkpoints and step > 1 else "")) from None
        if cfg.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with profiled(cfg, step, rank, log):
            n_trained, n_pad = step_counts(batch, setup.mesh.get_local_rank("cp"), setup.device)
            loss, grad_norm, applied, by_position, aux_loss = train_step(setup.model, run.opt, batch, n_trained,
                                                                         cfg, lr_at(step, cfg, run.lr_anchor))
        if step == run.done + 1:  # the run has started: now its files are written
            on_rank0(lambda: begin_files(cfg, run, log), device)
            eval_log = open_eval_log(cfg, run.done, device) if cfg.eval_every else None
            if eval_log and first_eval:
                eval_log.write(first_eval)
            if first_needles:  # rank 0's retrieval row of step 0
                retrieval.write_files(cfg, first_needles, log)
            log(f"time to first step: {time.time() - t_start:.1f} s (start-up, weights, data, first step)")
        step_times.append(time.time() - t0)
        eta = progress(time.time() - t_loop, step_times, cfg.max_steps - step)
        log_step(cfg, run, step, loss, by_position, grad_norm, applied, step_times[-1], eta, world, log, batch,
                 n_trained, n_pad, aux_loss)
        if n_trained:  # a step with nothing to train on is neither a failure nor a dead model
            skipped, zero_norm = (0 if applied else skipped + 1), (zero_norm + 1 if grad_norm == 0 else 0)
        check_health(cfg, step, skipped, zero_norm, log)
        if eval_due(cfg, step):
            evaluate(cfg, setup, make_batches, step, eval_log, log)
        code = stop.code()  # this rank's reason to stop, or 0
        timed = cfg.ckpt_every_min > 0 and time.time() - last_save > 60 * cfg.ckpt_every_min
        stopping, timed = parallel.agree([code, timed], setup.device)  # one collective per step
        due = stopping or timed or (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.max_steps
        if due and cfg.checkpoints:
            save_checkpoint(cfg, run, step, log)
            last_save, saved = time.time(), step
        if stopping:
            why = StopRequest.REASONS[(code or int(stopping)) - 1] + ("" if code else ", on another rank")
            log(f"stopping after step {step} ({why}), with a checkpoint; "
                f"relaunch the same command to continue. Exit code {EXIT_PREEMPTED}")
            run.batches.close()
            return EXIT_PREEMPTED
    run.batches.close()
    if cfg.save_dir:
        export_hf(cfg, setup, log)
    return 0


def begin_files(cfg: TrainConfig, run: Run, log):
    """Rank 0, once step 1 is done: out_dir's files (rundir.begin) and train.log."""
    run.metrics = rundir.begin(cfg.out_dir, run.done, dataclasses.asdict(cfg), run.launch, run.lock)
    log.open(os.path.join(cfg.out_dir, "train.log"))


def check_health(cfg: TrainConfig, step: int, skipped: int, zero_norm: int, log):
    if zero_norm == 3:
        log("warning: the gradient norm has been exactly 0 for 3 steps: the model may be dead (a loss flat at "
            "ln(vocab) says so); check --lr and the data")
    if skipped >= cfg.max_skipped_steps:
        raise SharedError(f"error: {skipped} steps in a row had a non-finite loss or gradient norm (the last at step "
                          f"{step}); they changed no weights. Lower --lr, check the data, or resume from an earlier "
                          "checkpoint")


def attention_area(batch: list[data.Micro]) -> float:
    """The share of the full causal triangle that a step's attention computes: 1 for one sequence, the sum of
    len^2 over len^2 of the window for packed documents (this rank's windows)."""
    return sum(1.0 if m.doc_lens is None else sum(n * n for n in m.doc_lens) / sum(m.doc_lens) ** 2
               for m in batch) / len(batch)


def clock(seconds: float) -> str:
    """mm:ss, or h:mm:ss from an hour on, as tqdm writes a time."""
    minutes, s = divmod(round(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def progress(elapsed_s: float, step_times: list[float], steps_left: int) -> str:
    """'elapsed<remaining, rate' as TRL's progress bar writes it ('06:20<1:09:41, 380.10s/it'): the time left is
    the median step time of this launch times the steps left."""
    per = statistics.median(step_times)
    rate = f"{per:.2f}s/it" if per >= 1 else f"{1 / max(per, 1e-9):.2f}it/s"
    return f"{clock(elapsed_s)}<{clock(per * steps_left)}, {rate}"


def log_step(cfg, run: Run, step, loss, by_position, grad_norm, applied, dt, eta, world, log, batch, n_trained,
             n_pad, aux_loss=None):
    """One metrics.jsonl row and one printed line, which opens with 'step N/max [elapsed<remaining, rate]'.
    aux_loss: a MoE's load-balancing term (router_aux_loss_coef x aux), logged apart from loss."""
    peak = peak_memory(cfg, run.setup.device)
    offload = run.setup.model.layers[0].offload
    host = offload.host_bytes() if offload is not None else 0
    lr = run.opt.param_groups[0]["lr"]
    flops = run.flops[0] + run.flops[1] * attention_area(batch)
    rec = dict(step=step, loss=loss, grad_norm=grad_norm, num_tokens=n_trained, lr=lr, step_time_s=dt,
               tokens_per_s=run.n_pairs / dt,
               mfu=flops / dt / (world * cfg.peak_tflops * 1e12) if cfg.device == "cuda" else None,
               peak_mem_gib=peak / 2**30, host_pinned_gib=host / 2**30,
               loss_by_position=by_position,  # [--loss_buckets] means over equal spans of position
               skipped_rows=run.batches.skipped)  # rows of the data left out so far, text or not
    if aux_loss is not None:
        rec["aux_loss"] = aux_loss
    if batch[0].doc_lens is not None:  # packed documents: what the windows held
        cp, balanced = run.setup.mesh.get_group("cp").size(), cfg.doc_attention == "balanced"
        rec.update(docs=sum(len(m.doc_lens) - (m.pad > 0) for m in batch) / len(batch),  # padding is no document
                   pad_share=n_pad / run.n_pairs,
                   untrained_share=1 - (n_trained + n_pad) / run.n_pairs,
                   # the busiest rank's attention over a full causal window's: what plan.py times
                   attn_area=sum(documents.document_area(m.doc_lens, cp, balanced) for m in batch) / len(batch))
    if not applied:
        rec["skipped"] = True
    why = "nothing to train on in these windows" if not n_trained else "non-finite loss or grad norm"
    log(f"step {step:4d}/{cfg.max_steps} [{eta}] | loss {loss:.4f} | "
        + (f"aux loss {aux_loss:.4f} | " if aux_loss is not None else "")
        + f"grad norm {grad_norm:.3f} | lr {lr:.2e} | {rec['tokens_per_s']:,.0f} tok/s | "
        + (f"MFU {rec['mfu']:.1%} | " if rec["mfu"] is not None else "")
        + f"{dt:.2f} s | peak mem {rec['peak_mem_gib']:.1f} GiB"
        + (f" | {rec['docs']:.0f} docs, {rec['pad_share']:.1%} padding, {rec['untrained_share']:.1%} untrained"
           if "docs" in rec else "")
        + ("" if applied else f" | SKIPPED: {why}, no weight changed"))
    if run.metrics:
        run.metrics.write(rec)


# ---------------------------------------------------------------------------------------------
# Saving: checkpoints (the HF export is export.py's)
# ---------------------------------------------------------------------------------------------

def save_checkpoint(cfg: TrainConfig, run: Run, step: int, log):
    """A checkpoint of step `step` in out_dir/checkpoints (checkpoint.save), never of non-finite weights."""
    if not all_finite(run.setup.model):
        raise SharedError(f"error: the weights hold non-finite values at step {step}; not saving them. The newest "
                          "checkpoint in out_dir is the last good state")
    t0 = time.time()
    model_sd, optim_sd = get_state_dict(run.setup.model, run.opt, options=checkpoint.STATE)
    root = os.path.join(cfg.out_dir, "checkpoints")
    checkpoint.save(root, step, {"model": model_sd, "optim": optim_sd},
                    {"step": step, "data": run.batches.state_dict(), "config": dataclasses.asdict(cfg),
                     "lr_anchor": run.lr_anchor},
                    run.fingerprint, keep=cfg.keep_checkpoints)
    log(f"checkpoint: step {step} saved to {checkpoint.step_dir(root, step)} in {time.time() - t0:.1f} s")


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def main(argv):
    t_start, rank = time.time(), int(os.environ.get("RANK", "0"))
    log = Log(rank)
    try:
        cfg, given = config.parse_args(argv)
        config.check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    except SystemExit as e:  # every rank finds the same fault in the flags: rank 0 alone says it
        if rank == 0 and isinstance(e.code, str):
            log.error(e.code)
        elif isinstance(e.code, str):
            time.sleep(QUIET_EXIT_S)
        sys.exit(2 if isinstance(e.code, str) else e.code)
    cp = config.context_parallel(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before the first allocation
    watchdog = None
    try:
        rank, world, store = init_distributed(cfg)
        watchdog = Watchdog(store, rank, world, log)
        code = train(cfg, given, cp, rank, world, t_start, log)
    except BaseException as e:
        stop_on_error(e, cfg, cp, rank, log, watchdog)
    watchdog.finished()
    dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
