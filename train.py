"""Fine-tune Qwen3 on single sequences of a million tokens: FSDP2 over all ranks, ring attention over the
ranks of a context-parallel group, data parallel over the rest.

    torchrun --standalone --nproc_per_node 2 train.py --config demo     # CPU, gloo, tiny Qwen3, ~1 minute
    torchrun --standalone --nproc_per_node 8 train.py                   # Qwen3-8B, 1,048,576 tokens a step
    python train.py --help                                              # every flag (million/config.py)

Read top to bottom: the ranks, building (model, optimizer, data), the step, the loop, main. Each extension
enters at the line that reads its flag, with its import there (million/README.md is the guide to them); the run
infrastructure (flags, run folder, resume and checkpoints, signals) is one call each. A run is its --out_dir:
relaunching the same command after any stop continues it with the same losses (million/resume.py).
"""
import datetime
import functools
import gc
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # read once, by `import torch` below

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.rendezvous import rendezvous

import data
import parallel
from model import Qwen3, Qwen3Config
from million import config, evaluate, hf, kernels, profiling, resume
from million.metrics import Meter, describe
from million.survival import (EXIT_PREEMPTED, QUIET_EXIT_S, Log, SharedError, StopRequest, Watchdog, from_rank0,
                              on_rank0, stop_on_error)


# ---------------------------------------------------------------------------------------------
# Ranks
# ---------------------------------------------------------------------------------------------

def init_distributed(cfg):
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
# Building: the mesh and the ring, the model, the optimizer, the data
# ---------------------------------------------------------------------------------------------

@dataclass
class Setup:
    """What training and evaluation share, built by build()."""
    mesh: object             # DeviceMesh (dp, cp): a cp group is cp consecutive ranks; FSDP2 shards over all
    model: torch.nn.Module
    mcfg: object             # the model's config (model.Qwen3Config or an extension's)
    model_path: str | None   # the local folder of --model (None for "tiny")
    shapes: dict             # every parameter's full shape (before sharding)
    device: torch.device


def build(cfg, given: set, cp: int, world: int, device, log) -> Setup:
    """One device mesh, ring attention over its cp groups, the model sharded over every rank and loaded."""
    torch.manual_seed(cfg.seed)
    mesh = init_device_mesh(cfg.device, (world // cp, cp), mesh_dim_names=("dp", "cp"))  # cp groups: consecutive ranks
    path, mcfg = from_rank0(on_rank0(lambda: model_config(cfg), device))  # rank 0 reads it, says what is wrong
    schedule, packed = parallel.zigzag_schedule, config.packs_documents(cfg)  # not for text (books, PG-19)
    if packed:  # windows of documents: the ring computes only the blocks inside them
        from million import documents
        schedule = functools.partial(documents.schedule, balanced=cfg.doc_attention == "balanced")
    ring_kernels = kernels.Kernels(cfg.attn_backend, mcfg.head_dim, packed)  # for this model's heads
    attn = parallel.RingAttention(mesh.get_group("cp"), ring_kernels, schedule)
    path = model_folder(cfg.model) if path and not os.path.isdir(path) else path  # a node without rank 0's disk
    if cfg.fit == "auto" or cfg.device == "cpu":  # levers chosen to fit this node (plan.py); a CPU's RAM checked
        from million import fit
        fit.plan_levers(cfg, mcfg, world, given, device, log)
    if cfg.param_dtype == "bfloat16" and not cfg.stochastic_rounding:
        log("warning: --param_dtype bfloat16 keeps weights and AdamW states in bf16: an update smaller than about "
            "1/256 of a weight rounds away (at lr 1e-5, 98% of weights do not move). Add --stochastic_rounding "
            "true, or use float32 unless you are matching a bf16 recipe (as bench/ does)")
    model, shapes = build_model(cfg, mcfg, path, mesh, attn, device)
    log(f"model: {describe(mcfg, shapes)}; attention kernels: {kernels.describe(attn.kernels, cfg.attn_backend)}")
    if cfg.lora_rank:
        from million import lora
        log(lora.describe(model))
    if cfg.offload:  # say how much host memory is pinned, and stop now if this node cannot hold it
        from million import fit
        fit.check_host_memory(cfg, mcfg, world, log)
    return Setup(mesh, model, mcfg, path, shapes, device)


def model_folder(spec: str) -> str:
    """--model as a local folder (a hub id is downloaded); errors name the flag."""
    try:
        return hf.local_folder(spec)
    except (OSError, ValueError) as e:
        raise type(e)(f"--model {e}") from None


def model_config(cfg):
    """-> (--model's local folder, None for "tiny"; its config, with --yarn_factor applied)."""
    path = None if cfg.model == "tiny" else model_folder(cfg.model)
    mcfg = Qwen3Config.tiny() if path is None else hf.read_config(path)
    config.check_model(cfg, mcfg)  # the flags that need config.json (a hub id's: read only now)
    return path, (mcfg.yarn_scaled(cfg.yarn_factor, cfg.yarn_original_max_position_embeddings) if cfg.yarn_factor
                  else mcfg)


def build_model(cfg, mcfg, path, mesh, attn_fn, device):
    """Meta-device model -> memory levers -> FSDP2 shards -> weights read (or drawn) once on rank 0 and broadcast.
    -> (model, every parameter's full shape)."""
    pdtype = getattr(torch, cfg.param_dtype)
    with torch.device("meta"):
        if getattr(mcfg, "model_type", "") == "qwen3_5":  # hybrid: DeltaNet layers carry state over the cp ranks
            from million import qwen3_5
            model = qwen3_5.build(cfg, mcfg, attn_fn, mesh.get_group("cp")).to(pdtype)
        elif getattr(mcfg, "num_experts", 0):  # Qwen3-MoE: its blocks take a mixture of experts as their MLP
            from million import moe
            cp_group = mesh.get_group("cp")  # the load-balancing loss sums the router's counts over a sequence
            model = moe.Qwen3MoE(mcfg, attn_fn, cp_sum=lambda t: dist.all_reduce(t, group=cp_group)).to(pdtype)
        else:
            model = Qwen3(mcfg, attn_fn).to(pdtype)
    base_dtype = getattr(torch, cfg.dtype) if cfg.lora_rank else pdtype  # LoRA: the frozen base in --dtype
    if cfg.lora_rank:  # adapters on the built model's projections, before it is sharded
        from million import lora
        lora.apply(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, base_dtype, cfg.quantize)
    shapes = {n: list(t.shape) for n, t in model.state_dict().items()}  # before sharding (then it is collective)
    L = mcfg.num_hidden_layers
    count = lambda on, n: 0 if not on else L if n < 0 else min(n, L)  # noqa: E731  (-1: every block)
    model.set_levers(recompute=cfg.recompute, offload=cfg.offload, offload_layers=count(True, cfg.offload_layers),
                     keep_attention=cfg.keep_attention, keep_attention_layers=count(True, cfg.keep_attention_layers),
                     mlp_tile=cfg.mlp_tile if cfg.tiled_mlp else 0)
    if cfg.lora_rank:  # the last blocks keep their MLP's gate and up outputs for the backward
        lora.keep_mlp(model, count(True, cfg.keep_mlp_layers))
    # FSDP2 over every rank, the param_dtype shards gathered as --dtype, on the world group as it is: a flattened
    # (dp, cp) mesh makes a process group whose teardown at exit can abort a gloo rank (bench/NOTES.md, train.py)
    parallel.shard_model(model, DeviceMesh.from_group(dist.group.WORLD, cfg.device),
                         param_dtype=getattr(torch, cfg.dtype))
    model.to_empty(device=device)
    # rank 0 keeps the full weights; the same random draw for any world size: the cp-equivalence of runs depends on it
    sd = on_rank0(lambda: full_state_dict(cfg, mcfg, path, shapes, base_dtype, device), device)
    if cfg.quantize:  # the weights to NF4, one at a time out of sd (they waited on meta): bf16 never whole on a GPU
        lora.quantize(model, sd, device)
    set_model_state_dict(model, sd or {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model, shapes


def full_state_dict(cfg, mcfg, path, shapes: dict, dtype, device) -> dict:
    """Rank 0: the checkpoint's weights (or a random draw for a folder without weights), and LoRA's adapters."""
    if not cfg.lora_rank:
        return hf.load_or_init_state_dict(path, mcfg, list(shapes), dtype, cfg.seed, device)
    from million import lora
    base = [n for n in shapes if not lora.is_adapter(n)]
    return {**hf.load_or_init_state_dict(path, mcfg, base, dtype, cfg.seed, device),
            **lora.adapter_state_dict(shapes, cfg.seed)}


def make_optimizer(cfg, model) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapters alone
    if cfg.stochastic_rounding:  # bf16 weights and moments, updated by stochastic rounding
        from million import optim
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


def make_batches(cfg, setup: Setup, source: str, split: str, grad_accum: int) -> data.Batches:
    """This rank's micro-batches of `source` (its `split`): one loader per data-parallel group (data.Batches)."""
    dp, dp_rank = setup.mesh.size(0), setup.mesh.get_local_rank("dp")
    kw = dict(seed=cfg.seed, revision=cfg.data_revision, split=split, text_column=cfg.data_column)
    if cfg.data_repo:
        kw["repo"] = cfg.data_repo
    if config.packs_documents(cfg):  # rows as documents (conversations, prompt/completion), unless all are text
        from million import chat
        batches = chat.make_batches(cfg, setup, source, kw, grad_accum)
        if batches is not None:
            return batches

    def make_loader():  # books laid end to end, as read
        tok = data.load_tokenizer(data.tokenizer_spec(cfg.tokenizer, setup.model_path))
        if tok.vocab_size > setup.mcfg.vocab_size:
            raise ValueError(f"tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
                             f"{setup.mcfg.vocab_size}; use the model's own tokenizer")
        docs = lambda start: data.tokenized(data.iter_books(source, start_book=start, **kw), tok)  # noqa: E731
        return data.WindowLoader(docs, cfg.seq_len, dp_rank=dp_rank, dp_size=dp)
    return data.Batches(make_loader, cfg.seq_len, grad_accum, setup.mesh.get_group("cp"), setup.device)


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------

def lr_at(step: int, cfg, anchor=None) -> float:
    """Linear warmup over warmup_steps, then cosine down to lr * min_lr_ratio at max_steps (steps from 1).
    anchor [d, f]: after step d the cosine starts from the fraction f of lr instead (resume.schedule_anchor)."""
    if anchor is not None and step > anchor[0]:
        start, top = anchor
    elif step <= cfg.warmup_steps:
        return cfg.lr * step / max(cfg.warmup_steps, 1)
    else:
        start, top = cfg.warmup_steps, 1.0
    t = min((step - start) / max(cfg.max_steps - start, 1), 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (top - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def step_counts(batch: list, cp_rank: int, device) -> tuple[int, int]:
    """(trained pairs, padding pairs) in this step's windows over every rank: the loss's divisor, counted from the
    labels each step (never a constant of the config: conversations train on part of their tokens)."""
    pad = sum(getattr(m, "pad", 0) for m in batch) if cp_rank == 0 else 0
    t = torch.stack([sum((m.labels != -100).sum() for m in batch), torch.tensor(pad, device=device)])
    dist.all_reduce(t)
    return tuple(t.tolist())


def train_step(model, opt, batch: list, n_trained: int, cfg, lr: float):
    """Forward + backward over the micro-batches, clip, AdamW. -> (loss, grad_norm, applied, loss_by_position,
    aux_loss): loss is the global mean NLL over the n_trained target tokens of every rank and micro-batch (a rank
    holding none still runs every collective, adding zero), also by --loss_buckets spans of position; aux_loss a
    MoE's load-balancing term on that scale (in the gradient, not in loss). A non-finite loss or grad norm (the
    same on every rank: both are all-reduced), or a step with nothing to train on, changes no weight."""
    for g in opt.param_groups:
        g["lr"] = lr
    sums = evaluate.PositionSums(cfg.seq_len, cfg.loss_buckets, batch[0].labels.device)
    for m in batch:
        out = model(m.inputs, m.positions, m.labels, loss_chunk=cfg.loss_chunk, doc_lens=getattr(m, "doc_lens", None))
        total = out.total() if hasattr(out, "total") else out.loss_sum  # a MoE adds its load-balancing term
        (total / max(n_trained, 1)).backward()  # each rank's share of the global mean; FSDP2 sums gradients
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

def train(cfg, given: set, cp: int, rank: int, world: int, t_start: float, log) -> int:
    log(f"config: {config.summary(cfg)} (every value: {cfg.out_dir}/train_config.json once step 1 is done)")
    log(f"world {world} = data parallel {world // cp} x context parallel {cp}; {cfg.seq_len // cp:,} tokens per rank")
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    if cfg.eval_only:  # held-out loss of a model or a run's newest checkpoint, no training
        from million.evaluate import evaluate_only
        return evaluate_only(cfg, given, cp, world, device, log, build, make_batches)
    lock = resume.take_out_dir(cfg, device)  # a second launch into the same --out_dir stops here
    try:
        setup = build(cfg, given, cp, world, device, log)
        opt = make_optimizer(cfg, setup.model)
        batches = make_batches(cfg, setup, cfg.data, cfg.data_split, cfg.grad_accum)
        run = resume.resume(cfg, setup, opt, batches, lock, cp, world, log, lr_at)  # the newest checkpoint, if any
    except BaseException:
        if lock:
            lock.abandon()
        raise
    if run.done >= cfg.max_steps:
        log(f"the run in {cfg.out_dir} is complete (step {run.done} of --max_steps {cfg.max_steps}); nothing to do. "
            "Raise --max_steps to train on, or use another --out_dir")
        return 0
    code = loop(cfg, run, rank, world, t_start, log)
    run.batches.close()
    if code == 0 and cfg.save_dir:  # the HF folder transformers loads (a PEFT adapter folder with LoRA)
        from million.export import export_hf
        export_hf(cfg, setup, log)
    return code


def loop(cfg, run, rank: int, world: int, t_start: float, log) -> int:
    """Steps from the one after the checkpoint to --max_steps, each logged; checkpoints when due; held-out
    evaluation with --eval_every. -> 0, or EXIT_PREEMPTED when a signal asked the run to stop."""
    setup = run.setup
    first_eval = evaluate.evaluate(cfg, setup, make_batches, 0, None, log, hold=True) \
        if run.done == 0 and evaluate.eval_due(cfg, 0) else (None, None)  # the model as it came, before any step
    meter = Meter(cfg, run, world)
    stop = StopRequest()  # from here on a signal ends the run with a checkpoint; before, it ends it at once
    last_save, skipped, zero_norm = time.time(), 0, 0
    setup.model.train()
    for step in range(run.done + 1, cfg.max_steps + 1):
        t0 = time.time()
        batch = next_batch(cfg, run, step, log)
        if batch is None:
            break
        if cfg.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with profiling.profiled(cfg, step, rank, log):
            n_trained, n_pad = step_counts(batch, setup.mesh.get_local_rank("cp"), setup.device)
            result = train_step(setup.model, run.opt, batch, n_trained, cfg, lr_at(step, cfg, run.lr_anchor))
        if step == run.done + 1:  # the run has started: now its files are written
            on_rank0(lambda: resume.begin_files(cfg, run, log), setup.device)
            meter.eval_log = evaluate.start_eval_log(cfg, run.done, setup.device, *first_eval, log)
            log(f"time to first step: {time.time() - t_start:.1f} s (start-up, weights, data, first step)")
        meter.log_step(step, result, time.time() - t0, batch, n_trained, n_pad, log)
        if n_trained:  # a step with nothing to train on is neither a failure nor a dead model
            skipped, zero_norm = (0 if result[2] else skipped + 1), (zero_norm + 1 if result[1] == 0 else 0)
        resume.check_health(cfg, step, skipped, zero_norm, log)
        if evaluate.eval_due(cfg, step):
            evaluate.evaluate(cfg, setup, make_batches, step, meter.eval_log, log)
        code = stop.code()  # this rank's reason to stop, or 0
        timed = cfg.ckpt_every_min > 0 and time.time() - last_save > 60 * cfg.ckpt_every_min
        stopping, timed = parallel.agree([code, timed], setup.device)  # one collective per step
        if cfg.checkpoints and (stopping or timed or (cfg.ckpt_every and step % cfg.ckpt_every == 0)
                                or step == cfg.max_steps):
            resume.save_checkpoint(cfg, run, step, log)
            last_save, run.saved = time.time(), step
        if stopping:
            why = StopRequest.REASONS[(code or int(stopping)) - 1] + ("" if code else ", on another rank")
            log(f"stopping after step {step} ({why}), " + ("with a checkpoint; relaunch the same command to continue"
                if cfg.checkpoints else "with no checkpoint (--checkpoints false)") + f". Exit code {EXIT_PREEMPTED}")
            return EXIT_PREEMPTED
    return 0


def next_batch(cfg, run, step: int, log) -> list | None:
    """Step `step`'s micro-batches; None when the data ran out (the run ends there, as at --max_steps). A data
    error stops the run; the steps done so far are saved first."""
    try:
        return run.batches.next()
    except (data.DataEnd, data.DataError) as e:
        if run.saved < step - 1 and cfg.checkpoints:
            resume.save_checkpoint(cfg, run, step - 1, log)
        if isinstance(e, data.DataEnd):
            log(f"the data ran out after step {step - 1}; ending the run there, as at --max_steps")
            return None
        raise SystemExit(f"{e}; the run stopped before step {step}" + (
            f" with a checkpoint of step {step - 1}" if cfg.checkpoints and step > 1 else "")) from None


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
    watchdog = None
    try:
        rank, world, store = init_distributed(cfg)
        watchdog = Watchdog(store, rank, world, log)  # a rank that dies or hangs ends every rank, with one line
        code = train(cfg, given, cp, rank, world, t_start, log)
    except BaseException as e:
        stop_on_error(e, cfg, cp, rank, log, watchdog)
    watchdog.finished()
    gc.collect()  # the FSDP2 model's reference cycles, freed while the interpreter lives (bench/NOTES.md, train.py)
    dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
