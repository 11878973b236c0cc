"""Fine-tune Qwen3 on single sequences of a million tokens: FSDP2 over all ranks, ring attention over the
ranks of a context-parallel group, data parallel over the rest.

    torchrun --standalone --nproc_per_node 2 train.py --config demo     # CPU, gloo, tiny Qwen3, ~1 minute
    torchrun --standalone --nproc_per_node 8 train.py                   # Qwen3-8B, 1,048,576 tokens a step

Every field of TrainConfig is a flag (`--key value`, booleans take true/false). The resolved config is printed
and saved in --out_dir; each step appends a line to --out_dir/metrics.jsonl.

A run is its --out_dir. Relaunching the same command after any stop (a crash, kill -9, SIGTERM, a requeue, a
torchrun restart) continues from the newest complete checkpoint (checkpoint.py, rundir.py) with the same losses
as if it had never stopped. SIGTERM, SIGINT and SIGUSR1 end the run at the next step boundary with a checkpoint
and exit code 75 (EXIT_PREEMPTED). A step whose loss or gradient norm is not finite changes no weight.

Read top to bottom: the config, the ranks, building (model, optimizer, data), the step, the loop, evaluation,
saving, main.
"""
import contextlib
import dataclasses
import datetime
import difflib
import inspect
import json
import math
import re
import os
import resource
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.rendezvous import rendezvous

import checkpoint
import data
import optim
import parallel
import plan
import retrieval
import rundir
from model import Qwen3, Qwen3Config, load_or_init_state_dict, local_folder, save_hf

EXIT_PREEMPTED = 75  # a signal asked the run to stop; it saved a checkpoint: relaunch the same command to continue


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
    # rows: {"text"}, {"messages": [...]} or {"prompt", "completion"} (data.py); conversations use the chat
    # template of the tokenizer's folder
    packing: str = "auto"         # concat: texts end to end, attending across (PG-19) | docs: each document
                                  # attends to itself alone | auto: concat for text rows, docs for the others
    doc_attention: str = "balanced"  # docs: balanced (chunks dealt to ranks by the mask's area; FA4 runs a rank's
                                     # documents in one call) | simple (zigzag, a call per document piece; slower)
    assistant_only_loss: bool = True   # messages rows: train on the assistant's turns only
    completion_only_loss: bool = True  # prompt/completion rows: train on the completion only
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
                                  # (~1/256 of the weight) is lost: at lr 1e-5 most weights would never move,
                                  # unless --stochastic_rounding true
    stochastic_rounding: bool = False  # with --param_dtype bfloat16: updates computed in fp32, rounded to bf16 at
                                       # random (optim.py): small updates kept on average, 8 bytes per parameter
    attn_backend: str = "auto"    # auto | fa4 | cudnn | flash: the CUDA attention kernels (parallel.py)
    # memory levers (model.py, section 2). With --fit auto, plan.py sets those not given on the command line
    fit: str = "auto"             # auto: the fastest levers predicted to fit this node (plan.py) | off: as given
    gpu_mem_gib: float = 0.0      # GPU memory per rank the plan may use (0 = what is free on the GPU now)
    host_mem_gib: float = 0.0     # host memory per node the plan may use (0 = RAM, or the cgroup's limit)
    recompute: bool = True        # recompute each block in backward, keeping only its input
    offload: bool = True          # keep what is kept in pinned host memory
    offload_layers: int = -1      # offload only the first N blocks' tensors (-1 = all): when host RAM is short
    keep_attention: bool = True   # keep attention's output + lse instead of recomputing attention in backward
    keep_attention_layers: int = -1  # keep it for the first N blocks only (-1 = all): the most time per host byte
    tiled_mlp: bool = True        # compute the MLP in sequence tiles of mlp_tile rows
    mlp_tile: int = 16384         # Qwen3-1.7B/131k on an H200: 8192 and 16384 give 15.87 s and 22.0 GiB, 32768
                                  # 15.82 s and 23.2 GiB (bench/results/mlp_tile.json): the peak is elsewhere
    loss_chunk: int = 2048        # rows of the chunked loss (bench/bench_loss.py: 3% slower than 4096, 1.8 GiB less)
    peak_tflops: float = 989.0    # per GPU, dense bf16 (H100/H200 SXM), for MFU
    # the run: its folder, checkpoints, resume, the HF export
    out_dir: str = "runs/qwen3-8b-1m"
    checkpoints: bool = True      # false: never write a checkpoint (benchmarks, throwaway runs)
    ckpt_every: int = 0           # a checkpoint every N steps (0 = by time only); always one at the end
    ckpt_every_min: float = 30.0  # ... and one when this many minutes have passed since the last (0 = off)
    keep_checkpoints: int = 2     # the newest K are kept; older ones are deleted once a newer one is complete
    resume: str = "auto"          # auto: continue from out_dir's newest checkpoint if any | none | a checkpoint folder
    overwrite: bool = False       # with --resume none: allow replacing an earlier run's files in out_dir
    save_dir: str = ""            # "" = no export; else an HF-format folder (weights, config, tokenizer) at the end
    max_skipped_steps: int = 3    # stop after this many steps in a row with a non-finite loss or gradient norm
    dist_timeout_min: float = 30.0  # a collective (or start-up) waiting longer than this stops the run
    profile_step: int = 0         # >0: trace this step with torch.profiler (+ CUDA memory history) into
                                  # out_dir/profile/; bench/profile_step.py summarises it. The step runs slower
    # loss by position (every step, in metrics.jsonl) and held-out evaluation (out_dir/eval.jsonl)
    loss_buckets: int = 16        # the mean loss over this many equal spans of the sequence's global positions
    eval_every: int = 0           # evaluate before the first step, every N steps and after the last; 0 = never
    eval_only: bool = False       # evaluate --model (with --yarn_factor, at --seq_len) once and stop: no training,
                                  # no checkpoint; a row is added to out_dir/eval.jsonl
    eval_data: str = ""           # "" = --data's --eval_split (synthetic: books no training stream reaches)
    eval_split: str = "validation"
    eval_sequences: int = 2       # held-out sequences of --seq_len tokens per evaluation (the same ones each time)
    # needle-in-a-haystack retrieval with each evaluation (retrieval.py): out_dir/retrieval.jsonl and retrieval.png
    retrieval: bool = False
    retrieval_lengths: str = ""   # window lengths in tokens, comma-separated; "" = --seq_len
    retrieval_depths: str = "0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1"  # where the needles sit: fractions of the
                                                                    # haystack
    retrieval_keys: int = 4       # needles per (length, depth)
    retrieval_needles: int = 0    # needles per window at most (one per depth); 0 = as many as fit in a quarter of it
    retrieval_data: str = ""      # the haystack's text (its --eval_split); "" = --eval_data, else --data
    retrieval_chat: str = "auto"  # true: rendered through the chat template | false: plain text | auto: true
                                  # when --packing is docs and the tokenizer has a chat template


PRESETS = {
    "qwen3-8b-1m": {},
    # ~45 s on 2 CPU cores with 2 ranks; the loss falls from 5.5 (uniform over 257 bytes) to ~2.4
    "demo": dict(model="tiny", tokenizer="byte", yarn_factor=0.0, data="synthetic", seq_len=4096, max_steps=150,
                 lr=3e-3, warmup_steps=10, weight_decay=0.0, device="cpu", dtype="float32", offload=False,
                 tiled_mlp=False, loss_chunk=512, out_dir="runs/demo"),
}


def parse_args(argv) -> tuple[TrainConfig, set]:
    """--config NAME picks a preset; every other --key value overrides one field. -> (config, the fields given
    on the command line: levers given there win over --fit auto's plan)."""
    if argv and argv[0] in ("-h", "--help"):
        if os.environ.get("RANK", "0") == "0":
            print(flag_help())
        sys.exit(0)
    if len(argv) % 2 or any(not k.startswith("--") for k in argv[::2]):
        raise SystemExit(f"error: arguments come in --key value pairs; got {argv}")
    pairs = {k[2:]: v for k, v in zip(argv[::2], argv[1::2])}
    name = pairs.get("config", TrainConfig.config)
    if name not in PRESETS:
        raise SystemExit(f"error: --config {name}: unknown preset; choose one of {sorted(PRESETS)}")
    cfg = TrainConfig(**{**PRESETS[name], "config": name})
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    for key, text in pairs.items():
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            raise SystemExit(f"error: --{key}: unknown flag" + (f"; did you mean --{near[0]}?" if near else "")
                             + " (python train.py --help lists every flag)")
        kind = type(getattr(cfg, key))
        if kind is bool:
            if text.lower() not in ("true", "false"):
                raise SystemExit(f"error: --{key} takes true or false, not {text!r}")
            value = text.lower() == "true"
        else:
            try:
                value = kind(text.replace("_", "")) if kind in (int, float) else text
            except ValueError:
                raise SystemExit(f"error: --{key} takes a {kind.__name__}, not {text!r}") from None
        setattr(cfg, key, value)
    return cfg, set(pairs) | set(PRESETS[name])


def flag_help() -> str:
    """`--help`: every flag with its default and the comment beside its field in TrainConfig."""
    lines, out = inspect.getsource(TrainConfig).splitlines(), []
    for line in lines:
        m = re.match(r"    (\w+): [^=]+= (.+?)(?:\s+# (.*))?$", line)
        if m:
            value = {"True": "true", "False": "false"}.get(m[2], m[2])  # as the command line spells them
            out.append(f"  --{m[1]} {value}" + (f"  # {m[3]}" if m[3] else ""))
        elif re.match(r"\s{20,}# ", line) and out:  # a comment continued on the next line
            out[-1] += " " + line.strip()[2:]
        elif line.strip().startswith("# "):
            out.append(line.strip())
    return ("usage: torchrun --nproc_per_node N train.py [--config PRESET] [--key value ...]; presets: "
            + ", ".join(PRESETS) + "\n" + "\n".join(out))


def human_count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.1f} K"


def check_config(cfg: TrainConfig, world: int) -> int:
    """Everything that can be said about the flags before any work starts (the same on every rank); -> cp."""
    def need(ok, msg):
        if not ok:
            raise SystemExit(f"error: {msg}")
    need(cfg.device in ("cuda", "cpu"), f"--device {cfg.device}: use cuda or cpu")
    need(cfg.device == "cpu" or torch.cuda.is_available(), "--device cuda but no GPU is visible; use --device cpu")
    for key in ("dtype", "param_dtype"):
        need(getattr(cfg, key) in ("bfloat16", "float32"), f"--{key} {getattr(cfg, key)}: use bfloat16 or float32")
    need(cfg.fit in ("auto", "off"), f"--fit {cfg.fit}: use auto or off")
    need(not cfg.stochastic_rounding or cfg.param_dtype == "bfloat16",
         "--stochastic_rounding true rounds updates into bf16 weights: it needs --param_dtype bfloat16")
    need(cfg.packing in ("auto", *data.PACKINGS), f"--packing {cfg.packing}: use auto, concat or docs")
    need(cfg.doc_attention in ("balanced", "simple"), f"--doc_attention {cfg.doc_attention}: use balanced or simple")
    need(cfg.gpu_mem_gib >= 0 and cfg.host_mem_gib >= 0, "--gpu_mem_gib and --host_mem_gib must be >= 0")
    need(cfg.offload_layers >= -1 and cfg.keep_attention_layers >= -1,
         "--offload_layers and --keep_attention_layers count blocks: 0 or more, or -1 for every block")
    need(cfg.attn_backend in ("auto", "fa4", "cudnn", "flash"),
         f"--attn_backend {cfg.attn_backend}: use auto, fa4, cudnn or flash")
    need(cfg.cp >= 0, f"--cp {cfg.cp}: must be >= 1 (or 0 for the world size)")
    cp = cfg.cp or world
    need(world % cp == 0, f"--cp {cp} does not divide the world size {world}; data parallel = world / cp")
    need(cfg.seq_len > 0 and cfg.seq_len % (2 * cp) == 0,
         f"--seq_len {cfg.seq_len} must be a positive multiple of 2*cp = {2 * cp} (zigzag sharding cuts the "
         f"sequence into 2*cp equal chunks); e.g. --seq_len {max(2 * cp, cfg.seq_len // (2 * cp) * 2 * cp)}")
    for key in ("grad_accum", "max_steps", "loss_chunk", "keep_checkpoints", "max_skipped_steps"):
        need(getattr(cfg, key) >= 1, f"--{key} must be >= 1")
    need(cfg.lr > 0 and 0 <= cfg.min_lr_ratio <= 1 and cfg.warmup_steps >= 0, "--lr > 0, 0 <= --min_lr_ratio <= 1, "
         "--warmup_steps >= 0")
    need(cfg.ckpt_every >= 0 and cfg.ckpt_every_min >= 0, "--ckpt_every and --ckpt_every_min must be >= 0")
    need(cfg.dist_timeout_min > 0, "--dist_timeout_min must be > 0")
    need(cfg.resume in ("auto", "none") or os.path.isfile(os.path.join(cfg.resume, "manifest.json")),
         f"--resume {cfg.resume}: not a checkpoint folder (no manifest.json); use auto, none, or a folder "
         "out_dir/checkpoints/step_NNNNNNN")
    need(0 <= cfg.profile_step <= cfg.max_steps, f"--profile_step {cfg.profile_step}: 0 (off) or a step in "
         f"1..--max_steps; the first step includes warm-up, so 2 is the usual choice")
    need(cfg.grad_clip >= 0 and cfg.weight_decay >= 0, "--grad_clip and --weight_decay must be >= 0")
    need(not cfg.tiled_mlp or cfg.mlp_tile >= 1, "--mlp_tile must be >= 1 when --tiled_mlp true")
    need(cfg.yarn_factor == 0 or (cfg.yarn_factor >= 1 and cfg.yarn_original_max_position_embeddings >= 1),
         "--yarn_factor must be 0 (off) or >= 1, with --yarn_original_max_position_embeddings >= 1")
    need(1 <= cfg.loss_buckets <= cfg.seq_len, f"--loss_buckets must lie in 1..--seq_len, not {cfg.loss_buckets}")
    need(cfg.eval_every >= 0 and cfg.eval_sequences >= 1, "--eval_every must be >= 0 (0: never) and "
         "--eval_sequences >= 1")
    need(not (cfg.eval_every and not cfg.eval_only and not cfg.eval_data and os.path.isfile(cfg.data)),
         f"--data {cfg.data} is one file: it has no held-out split to evaluate on; pass --eval_data (a file or "
         "folder of books not trained on)")
    need(not cfg.retrieval or cfg.eval_every or cfg.eval_only, "--retrieval true runs with each evaluation: "
         "set --eval_every N or --eval_only true")
    need(cfg.retrieval_chat in ("auto", "true", "false"), f"--retrieval_chat {cfg.retrieval_chat}: auto, true or false")
    try:
        retrieval.parse_grid(cfg.retrieval_lengths, cfg.retrieval_depths, cfg.retrieval_keys, cfg.retrieval_needles,
                             cfg.seq_len, cp)
    except ValueError as e:
        need(False, str(e))
    return cp


# ---------------------------------------------------------------------------------------------
# Ranks: start-up, errors, stopping together
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
    # torchrun keeps one store across restarts of its workers: without a prefix per attempt, a restarted worker
    # could read the addresses its killed predecessor published there and fail to connect (seen under gloo)
    store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    dist.init_process_group("nccl" if cfg.device == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                            timeout=timeout)
    return rank, world, store


def write_line(stream, line: str) -> bool:
    """One line in one write (ranks share the launcher's streams: separate writes let two ranks' lines run
    together). If the reader went away (a closed pipe, a killed `tee`), the stream is pointed at /dev/null so
    that no later write, nor Python's flush at exit, fails again; the run goes on. -> whether it was written."""
    try:
        stream.write(line.replace("\n", " ") + "\n")
        stream.flush()
        return True
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        return False


class Log:
    """What a rank says. Rank 0's lines go to stdout and to out_dir/train.log (appended, flushed line by line),
    so that the run's record survives a lost terminal or a dead pipe. Lines said before the run is known to start
    are held and written when open() is called, so a start that fails leaves no file behind. Errors (any rank) go
    to stderr, and rank 0's to train.log too."""

    def __init__(self, rank: int):
        self.rank, self.fh, self.held = rank, None, []

    def __call__(self, line: str):
        if self.rank == 0:
            self._keep(line)
            write_line(sys.stdout, line)

    def error(self, line: str):
        if self.rank == 0:
            self._keep(line)
        write_line(sys.stderr, line)

    def _keep(self, line: str):
        if self.fh is None:
            self.held.append(line)
        else:
            write_line(self.fh, line)

    def open(self, path: str):
        if self.rank == 0 and self.fh is None:
            self.fh = open(path, "a")
            for line in self.held:
                write_line(self.fh, line)
            self.held = []


# A rank that leaves rank 0 to say an error they share waits this long before it exits: torchrun ends the other
# workers as soon as one exits, and rank 0 could be stopped before it printed the line.
QUIET_EXIT_S = 3.0


class RankZeroSaid(SystemExit):
    """An error every rank raises together (found by rank 0 in on_rank0, or agreed): rank 0 alone prints it."""


def on_rank0(fn, group=None):
    """Run fn on rank 0 only and give every rank its result, or its error: the other ranks then stop too
    instead of waiting forever in the next collective."""
    msg = [None, None]
    if dist.get_rank() == 0:
        try:
            msg[0] = fn()
        except SystemExit as e:  # a message of ours, already worded for the user
            msg[1] = str(e.code)
        except Exception as e:  # reported on every rank below
            msg[1] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(msg, src=0, group=group)
    if msg[1] is not None:
        raise RankZeroSaid(msg[1] if msg[1].startswith("error") else f"error (on rank 0): {msg[1]}")
    return msg[0]


class StopRequest:
    """SIGTERM, SIGINT, SIGUSR1 (what schedulers send before preemption) and SIGHUP (a lost terminal) only set a
    flag: the step in flight finishes, and at its end all ranks agree to save and exit. A second SIGINT stops at
    once. A worker whose launcher (torchrun) died stops the same way instead of training on as an orphan."""

    def __init__(self):
        self.signal = None
        self.parent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signal == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name

    def reason(self) -> str | None:
        if self.signal:
            return self.signal
        if self.parent is not None and os.getppid() != self.parent:
            return "the launcher (torchrun) died"
        return None


class Watchdog:
    """No rank waits forever for a peer that is gone. A collective whose peer died or froze would wait for
    --dist_timeout_min (NCCL's own watchdog) while holding the GPU; torchrun ends the others only when a worker
    exits. So a thread on every rank bumps a counter in the rendezvous store every `every_s` seconds and reads
    its peers'; a rank that stops with an error posts it there first. A rank whose peer posted an error and has
    not ended by itself `grace_s` later, or whose peer's counter has not moved for `stale_s` (the process died or
    froze), says so in one line and exits, from inside a collective if need be. Nothing is lost by that: a save
    needs every rank, so the newest checkpoint is already the last state that can be saved."""

    def __init__(self, store, rank: int, world: int, log, every_s=3.0, stale_s=30.0, grace_s=10.0):
        self.store, self.rank, self.world, self.log = dist.PrefixStore("watchdog/", store), rank, world, log
        self.every_s, self.stale_s, self.grace_s = every_s, stale_s, grace_s
        self.stop = threading.Event()
        if world > 1:
            threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def _watch(self):
        seen = {r: (-1, time.monotonic()) for r in range(self.world) if r != self.rank}  # counter, when it moved
        failed_at = None
        try:
            while not self.stop.wait(self.every_s):
                self.store.add(f"beat/{self.rank}", 1)
                now = time.monotonic()
                if self.store.add("failed", 0):
                    failed_at = failed_at or now
                    if now - failed_at > self.grace_s:
                        return self._end(self.store.get("error").decode())
                for r, (count, moved) in seen.items():
                    if self.store.add(f"done/{r}", 0):
                        continue
                    new = self.store.add(f"beat/{r}", 0)
                    if new != count:
                        seen[r] = (new, now)
                    elif now - moved > self.stale_s:
                        return self._end(f"rank {r} has not answered for {now - moved:.0f} s (it died or hangs)")
        except Exception:  # the store is gone with the launcher: StopRequest notices that at the step's end
            return

    def _end(self, why: str):
        self.log.error(f"error (rank {self.rank}): {why}; ending this rank. Relaunch the same command to continue "
                       "from the newest checkpoint")
        os._exit(1)

    def failed(self, msg: str):
        """This rank stops with an error: tell the others, who may be waiting for it in a collective."""
        with contextlib.suppress(Exception):
            self.store.set("error", msg)
            self.store.add("failed", 1)

    def finished(self):
        self.stop.set()
        with contextlib.suppress(Exception):
            self.store.add(f"done/{self.rank}", 1)


# ---------------------------------------------------------------------------------------------
# Building: the mesh, the model, the optimizer, the data
# ---------------------------------------------------------------------------------------------

@dataclass
class Setup:
    """What training and evaluation share, built by setup()."""
    mesh: object             # DeviceMesh (dp, cp): a cp group is cp consecutive ranks; FSDP2 shards over all
    model: torch.nn.Module
    mcfg: Qwen3Config
    model_path: str | None   # the local folder of --model (None for "tiny")
    shapes: dict             # every parameter's full shape (before sharding)
    device: torch.device


def setup(cfg: TrainConfig, given: set, cp: int, world: int, log) -> Setup:
    """One device mesh, ring attention over its cp groups, the model sharded over every rank and loaded."""
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    torch.manual_seed(cfg.seed)
    # A context-parallel group is cp consecutive ranks: one node when it fits
    mesh = init_device_mesh(cfg.device, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    attn = parallel.RingAttention(mesh.get_group("cp"), cfg.attn_backend, cfg.doc_attention == "balanced")
    model, mcfg, path, shapes = build_model(cfg, given, mesh, attn, device, log)
    n_params = sum(math.prod(s) for s in shapes.values())
    moe = (f" ({human_count(plan.Shape.of(mcfg, 1, 1, 1, 1).active_params)} active: top-{mcfg.num_experts_per_tok} "
           f"of {mcfg.num_experts} experts" + (", load-balancing loss" if mcfg.output_router_logits else "") + ")"
           if mcfg.num_experts else "")
    log(f"model: {mcfg.num_hidden_layers} layers, hidden {mcfg.hidden_size}, {human_count(n_params)} parameters{moe}, "
        f"rope_scaling {mcfg.rope_scaling}; attention kernels: {attn.backend}"
        + (f" ({parallel.fa4_unavailable()})" if cfg.attn_backend == "auto" and attn.backend == "cudnn" else ""))
    return Setup(mesh, model, mcfg, path, shapes, device)


def model_folder(spec: str) -> str:
    """--model as a local folder (a hub id is downloaded); errors name the flag."""
    try:
        return local_folder(spec)
    except (OSError, ValueError) as e:
        raise type(e)(f"--model {e}") from None


def build_model(cfg: TrainConfig, given: set, mesh, attn_fn, device, log):
    """Meta-device model -> FSDP2 shards -> weights read (or drawn) once on rank 0 and broadcast."""
    path = None if cfg.model == "tiny" else on_rank0(lambda: model_folder(cfg.model))  # downloads once
    if path is not None and not os.path.isdir(path):  # another node without rank 0's disk: its own copy
        path = model_folder(cfg.model)
    mcfg = Qwen3Config.tiny() if path is None else Qwen3Config.from_pretrained(path)
    if cfg.yarn_factor:
        mcfg = mcfg.yarn_scaled(cfg.yarn_factor, cfg.yarn_original_max_position_embeddings)
    plan_levers(cfg, mcfg, mesh.size(), given, device, log)
    pdtype = getattr(torch, cfg.param_dtype)
    # the load-balancing loss of a MoE sums the router's counts over the ranks of a sequence (Qwen3.router_aux_loss)
    cp_group = mesh.get_group("cp")
    with torch.device("meta"):
        model = Qwen3(mcfg, attn_fn, cp_sum=lambda t: dist.all_reduce(t, group=cp_group)).to(pdtype)
    shapes = {n: list(t.shape) for n, t in model.state_dict().items()}  # before sharding (then it is collective)
    lv = levers(cfg, mcfg.num_hidden_layers)
    model.set_levers(recompute=cfg.recompute, offload=lv.offload_layers > 0, offload_layers=lv.offload_layers,
                     keep_attention=lv.keep_attention_layers > 0, keep_attention_layers=lv.keep_attention_layers,
                     mlp_tile=cfg.mlp_tile if cfg.tiled_mlp else 0)
    # FSDP2 over every rank, gathering the param_dtype shards as --dtype for compute. Its mesh is the world group
    # as it is: a flattened (dp, cp) mesh (torchtitan's way) makes a new process group, whose teardown at exit
    # aborted a gloo rank about one run in two in our tests
    parallel.shard_model(model, DeviceMesh.from_group(dist.group.WORLD, cfg.device), param_dtype=getattr(torch, cfg.dtype))
    model.to_empty(device=device)
    held = {}  # rank 0 keeps the full weights; only the error, if any, is shared
    # the same random draw for any world size: the cp-equivalence of runs depends on it
    on_rank0(lambda: held.update(sd=load_or_init_state_dict(path, mcfg, list(shapes), pdtype, cfg.seed, device)))
    set_model_state_dict(model, held.get("sd", {}),
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model, mcfg, path, shapes


def levers(cfg: TrainConfig, layers: int) -> plan.Levers:
    """The memory levers as counts of blocks (the first ones), from the flags: --offload false and
    --keep_attention false mean none, --offload_layers -1 and --keep_attention_layers -1 mean every block."""
    def count(on, n):
        return 0 if not on else layers if n < 0 else min(n, layers)
    return plan.Levers(count(cfg.offload, cfg.offload_layers), count(cfg.keep_attention, cfg.keep_attention_layers),
                       cfg.tiled_mlp, cfg.mlp_tile)


def plan_shape(cfg: TrainConfig, mcfg, world: int) -> plan.Shape:
    return plan.Shape.of(mcfg, cfg.seq_len, cfg.cp or world, world, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                         param_bytes=getattr(torch, cfg.param_dtype).itemsize,
                         act_bytes=getattr(torch, cfg.dtype).itemsize, loss_chunk=cfg.loss_chunk,
                         attn_backend=parallel.resolve_backend(cfg.attn_backend),
                         stochastic_rounding=cfg.stochastic_rounding)


def plan_levers(cfg: TrainConfig, mcfg, world: int, given: set, device, log):
    """--fit auto: set the levers the command line did not, to the plan predicted to fit this node (plan.py);
    where fp32 state cannot fit, bf16 state with stochastic rounding. Every rank computes the same plan: the
    capacities are the smallest any rank sees."""
    lv = levers(cfg, mcfg.num_hidden_layers)
    fixed = {}  # what the user said wins
    if given & {"offload", "offload_layers"}:
        fixed["offload_layers"] = lv.offload_layers
    if given & {"keep_attention", "keep_attention_layers"}:
        fixed["keep_attention_layers"] = lv.keep_attention_layers
    if given & {"tiled_mlp", "mlp_tile"}:
        fixed.update(tiled_mlp=cfg.tiled_mlp, mlp_tile=cfg.mlp_tile)
    if cfg.fit == "off" or not cfg.recompute or (cfg.device == "cpu" and not cfg.gpu_mem_gib):
        why = "--fit off" if cfg.fit == "off" else "no recompute" if not cfg.recompute else "CPU"
        return log(f"fit: levers as given ({why})")
    caps = torch.tensor([cfg.gpu_mem_gib or plan.gpu_memory_gib(), cfg.host_mem_gib or plan.host_memory_gib()],
                        dtype=torch.float64, device=device)
    dist.all_reduce(caps, op=dist.ReduceOp.MIN)
    s = plan_shape(cfg, mcfg, world)
    try:
        lv, cost = plan.choose(s, caps[0].item(), caps[1].item(), fixed)
    except plan.NoFit as e:
        # fp32 state does not fit but bf16 might: bf16 weights and moments with stochastic rounding (optim.py),
        # unless the command line chose the dtype or the rounding
        if cfg.param_dtype != "float32" or given & {"param_dtype", "stochastic_rounding"}:
            raise SystemExit(f"error: --fit auto: {e}") from None
        s = dataclasses.replace(s, param_bytes=2, stochastic_rounding=True)
        try:
            lv, cost = plan.choose(s, caps[0].item(), caps[1].item(), fixed)
        except plan.NoFit as e2:
            raise SystemExit(f"error: --fit auto: {e2}") from None
        cfg.param_dtype, cfg.stochastic_rounding = "bfloat16", True
        log("fit: fp32 weights and AdamW states do not fit; bf16 ones with stochastic rounding do "
            "(--param_dtype bfloat16 --stochastic_rounding true)")
    cfg.offload, cfg.offload_layers = lv.offload_layers > 0, lv.offload_layers
    cfg.keep_attention, cfg.keep_attention_layers = lv.keep_attention_layers > 0, lv.keep_attention_layers
    cfg.tiled_mlp, cfg.mlp_tile = lv.tiled_mlp, lv.mlp_tile
    log(f"fit: {caps[0].item():.1f} GiB GPU per rank, {caps[1].item():.0f} GiB host per node -> "
        + plan.describe(lv, cost, s) + (f" (given: {', '.join(sorted(fixed))})" if fixed else ""))


def check_host_memory(cfg: TrainConfig, mcfg, world: int, log):
    """Pinned host memory for offloaded tensors: say how much, and stop before the first step if this machine
    cannot hold it for all of its ranks (pinned pages cannot be swapped out)."""
    s = plan_shape(cfg, mcfg, world)
    per_rank = plan.host_bytes(s, levers(cfg, mcfg.num_hidden_layers))
    local, total = s.ranks_per_node, (cfg.host_mem_gib or plan.host_memory_gib()) * 2**30
    log(f"offload: {per_rank / 2**30:.1f} GiB of pinned host memory per rank, {local * per_rank / 2**30:.1f} GiB for "
        f"the {local} rank(s) of this node ({total / 2**30:.0f} GiB RAM)")
    if local * per_rank > plan.HOST_MARGIN * total:  # the rest for the OS, page cache, the processes' own memory
        raise SystemExit(f"error: offloading needs {local * per_rank / 2**30:.0f} GiB of host RAM on this node but "
                         f"it has {total / 2**30:.0f} GiB; use --fit auto, --offload_layers N (fewer blocks "
                         "offloaded), --keep_attention_layers N, more context parallelism (--cp), or --offload false")


def make_optimizer(cfg: TrainConfig, model) -> torch.optim.Optimizer:
    if cfg.stochastic_rounding:
        opt = optim.AdamWStochastic(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                    weight_decay=cfg.weight_decay, seed=cfg.seed, rank=dist.get_rank())
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
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


def make_batches(cfg: TrainConfig, s: Setup, source: str, split: str, grad_accum: int) -> data.Batches:
    """This rank's micro-batches of `source` (its `split`): one loader per data-parallel group (data.Batches)."""
    dp, dp_rank = s.mesh.size(0), s.mesh.get_local_rank("dp")
    kw = dict(seed=cfg.seed, revision=cfg.data_revision, split=split, text_column=cfg.data_column)
    if cfg.data_repo:
        kw["repo"] = cfg.data_repo
    packing = cfg.packing if cfg.packing != "auto" else on_rank0(lambda: data.default_packing(
        source, **{k: v for k, v in kw.items() if k != "seed"}))

    def make_loader():
        tok = data.load_tokenizer(data.tokenizer_spec(cfg.tokenizer, s.model_path))
        if tok.vocab_size > s.mcfg.vocab_size:
            raise ValueError(f"tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
                             f"{s.mcfg.vocab_size}; use the model's own tokenizer")
        if packing == "concat":  # text laid end to end, as read
            rows = lambda start: data.iter_books(source, start_book=start, **kw)  # noqa: E731
        else:                    # each row a document: text, a conversation, a prompt and its completion
            rows = lambda start: data.iter_documents(  # noqa: E731
                source, tok, start_row=start, assistant_only_loss=cfg.assistant_only_loss,
                completion_only_loss=cfg.completion_only_loss, **kw)
        return data.WindowLoader(rows, tok, cfg.seq_len, dp_rank=dp_rank, dp_size=dp, packing=packing)
    return data.Batches(make_loader, cfg.seq_len, grad_accum, packing, s.mesh.get_group("cp"), s.device,
                        balanced=cfg.doc_attention == "balanced")


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
    """Forward + backward over the micro-batches, clip, AdamW. -> (loss, grad_norm, applied, loss_by_position),
    where loss is the global mean NLL over the n_trained target tokens of every rank and micro-batch (a rank
    holding none still runs every collective, adding zero), and loss_by_position the same mean over each of
    --loss_buckets spans of position. A non-finite loss or grad norm (the same on every rank: both are
    all-reduced), or a step with nothing to train on, skips the update: no weight changes."""
    for g in opt.param_groups:
        g["lr"] = lr
    sums = PositionSums(cfg.seq_len, cfg.loss_buckets, batch[0].labels.device)
    for m in batch:
        out = model(m.inputs, m.positions, m.labels, loss_chunk=cfg.loss_chunk, doc_lens=m.doc_lens)
        (out.loss_sum / max(n_trained, 1)).backward()  # each rank's share of the global mean; FSDP2 sums gradients
        sums.add(out, m)
    loss_sum, by_position = sums.reduce()
    grad_norm = parallel.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    loss = loss_sum / max(n_trained, 1)
    applied = bool(torch.isfinite(loss) & torch.isfinite(grad_norm)) and n_trained > 0
    if applied:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item(), grad_norm.item(), applied, by_position


class PositionSums:
    """The loss summed over rows, and over each of k equal spans of position: a row at position p (the input
    token whose successor is predicted; with packed documents, its place in its document) lies in span
    p·k // seq_len, wherever zigzag sharding put it. Adding chunked_nll's row_nll costs two index_adds of T/cp
    values; reduce() is one all-reduce of 2k + 1 numbers, the collective the loss alone needed anyway."""

    def __init__(self, seq_len: int, k: int, device):
        self.seq_len, self.k = seq_len, k
        self.acc = torch.zeros(1 + 2 * k, device=device)  # [loss sum, loss sum by span, targets by span]

    def add(self, out, m: "data.Micro"):
        """out: chunked_nll's result for one micro-batch's rows on this rank."""
        bucket = m.positions[0] * self.k // self.seq_len                     # [T/cp] the span of each row
        self.acc[0] += out.loss_sum.detach()
        self.acc[1:1 + self.k].index_add_(0, bucket, out.row_nll)
        self.acc[1 + self.k:].index_add_(0, bucket, (m.labels[0] != -100).to(self.acc.dtype))

    def reduce(self, group=None):
        """Summed over the ranks of `group` (default: all: context, data parallel) -> (loss sum as a 0-d tensor,
        [k] mean loss by span; None where it is not finite, as JSON has no NaN)."""
        dist.all_reduce(self.acc, group=group)
        k, acc = self.k, self.acc
        return acc[0], [x if math.isfinite(x) else None for x in (acc[1:1 + k] / acc[1 + k:]).tolist()]

    def count(self) -> int:
        """Target tokens summed (after reduce())."""
        return int(self.acc[1 + self.k:].sum().item())


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------

@dataclass
class Run:
    """What the loop works on, built by start_run."""
    s: Setup
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


# Flags a resumed run must keep: they define what the checkpoint holds (model, data stream, state dtype). The
# rest may change on resume (--max_steps, --lr, levers, checkpoint and eval cadence, ...), each named in the log.
FIXED_ON_RESUME = ("model", "tokenizer", "yarn_factor", "yarn_original_max_position_embeddings", "data",
                   "data_repo", "data_revision", "data_split", "data_column", "packing", "seq_len", "seed",
                   "param_dtype")


def resume_changes(cfg: TrainConfig, saved: dict) -> dict:
    """{flag: [value in the checkpoint's launch, value now]} for the flags that changed; stops on a fixed one."""
    now = dataclasses.asdict(cfg)
    changed = {k: [saved[k], v] for k, v in now.items()
               if k in saved and saved[k] != v and k not in ("config", "resume", "overwrite")}
    fixed = [k for k in changed if k in FIXED_ON_RESUME]
    if fixed:
        raise SystemExit("error: a resumed run keeps " + ", ".join(f"--{k} {saved[k]} (given: {now[k]})" for k in fixed)
                         + f"; use the values it started with, or another --out_dir for a new run")
    return changed


def schedule_anchor(cfg: TrainConfig, saved: dict, anchor, done: int) -> list | None:
    """Where the LR schedule continues from when its shape changed on resume (--max_steps, --warmup_steps or
    --min_lr_ratio): the fraction of --lr the run had reached at step `done`, on the old schedule. Without it,
    a cosine recomputed over a longer run jumps up (3e-4 -> 2.2e-3 in the demo raised from 150 to 300 steps)."""
    keys = ("max_steps", "warmup_steps", "min_lr_ratio")
    if all(saved.get(k) == getattr(cfg, k) for k in keys) or done <= saved.get("warmup_steps", 0):
        return anchor  # unchanged, or still warming up (the cosine has not begun: nothing to jump from)
    old = dataclasses.replace(cfg, **{k: saved[k] for k in (*keys, "lr")})
    return [done, lr_at(done, old, anchor) / old.lr]


def start_run(cfg: TrainConfig, given: set, cp: int, world: int, log) -> Run:
    """out_dir taken (rundir.Lock), the setup, the optimizer and the data; then the checkpoint to resume (if any),
    what changed since the last launch, and the output checks. Nothing in out_dir changes until step 1 is done,
    but the lock file."""
    held = {}
    on_rank0(lambda: held.update(lock=rundir.Lock(cfg.out_dir)))
    try:
        return _start_run(cfg, given, cp, world, log, held.get("lock"))
    except BaseException:
        if held.get("lock"):
            held["lock"].abandon()
        raise


def _start_run(cfg: TrainConfig, given: set, cp: int, world: int, log, lock) -> Run:
    s = setup(cfg, given, cp, world, log)
    if cfg.offload:
        check_host_memory(cfg, s.mcfg, world, log)
    if cfg.param_dtype == "bfloat16" and not cfg.stochastic_rounding:
        log("warning: --param_dtype bfloat16 keeps weights and AdamW states in bf16: an update smaller than about "
            "1/256 of a weight rounds away (at lr 1e-5, 98% of weights do not move). Add --stochastic_rounding "
            "true, or use float32 unless you are matching a bf16 recipe (as bench/ does)")
    opt = make_optimizer(cfg, s.model)
    batches = make_batches(cfg, s, cfg.data, cfg.data_split, cfg.grad_accum)
    data_fp = {k: getattr(cfg, k) for k in ("data", "data_repo", "data_revision", "data_split", "data_column",
                                            "seq_len", "seed")}
    fp = rundir.fingerprint(s.mcfg, s.shapes, data_fp, data.tokenizer_spec(cfg.tokenizer, s.model_path))
    resume_from = on_rank0(lambda: rundir.resume_point(cfg.out_dir, cfg.resume, cfg.overwrite, fp, log))
    done, anchor, changes = 0, None, {}
    if resume_from:
        t0 = time.time()
        model_sd, optim_sd = get_state_dict(s.model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        meta = checkpoint.load(resume_from, state)
        changes = resume_changes(cfg, meta["config"])
        set_state_dict(s.model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        batches.load_state_dict(meta["data"])
        done = meta["step"]
        anchor = schedule_anchor(cfg, meta["config"], meta.get("lr_anchor"), done)
        log(f"resumed from {resume_from} after step {done} (loaded in {time.time() - t0:.1f} s)")
        if changes:
            log("changed since the launch that saved it: " + "; ".join(f"--{k} {a} -> {b}" for k, (a, b) in
                                                                        changes.items()))
        if anchor != meta.get("lr_anchor") and done < cfg.max_steps:
            log(f"the LR schedule continues from {lr_at(done, cfg, anchor):.3g} at step {done} on a cosine to "
                f"{cfg.lr * cfg.min_lr_ratio:.3g} at step {cfg.max_steps}, without a jump (to warm up again, start "
                "a new run from an export: --model SAVE_DIR)")
    n_params, pbytes = sum(math.prod(x) for x in s.shapes.values()), getattr(torch, cfg.param_dtype).itemsize
    ckpt_bytes = 3 * n_params * pbytes if cfg.checkpoints else 0  # weights and two AdamW states
    needs = [(cfg.out_dir, "--out_dir", "a checkpoint", ckpt_bytes)]  # with --checkpoints false: writable, no size
    if cfg.save_dir:
        needs.append((cfg.save_dir, "--save_dir", "the exported model", n_params * pbytes))
    on_rank0(lambda: rundir.check_outputs(needs))
    if cfg.checkpoints:
        log(f"outputs: a checkpoint is about {rundir.human_bytes(ckpt_bytes)}; {cfg.keep_checkpoints} kept")
    dp = world // cp
    launch = dict(started=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                  host=socket.gethostname(), world=world, cp=cp, from_step=done, changes=changes, lr_anchor=anchor)
    shape, steps = plan_shape(cfg, s.mcfg, world), cfg.grad_accum * dp
    attention = 3 * plan.attention_fwd_flops(shape) * steps
    return Run(s, opt, batches, cfg.seq_len * steps, (plan.useful_flops(shape) * steps - attention, attention), fp,
               done, anchor, launch, lock)


def train(cfg: TrainConfig, given: set, cp: int, rank: int, world: int, t_start: float, log) -> int:
    preset = PRESETS[cfg.config]
    differ = [f"--{k} {v}" for k, v in dataclasses.asdict(cfg).items()
              if k != "config" and v != preset.get(k, getattr(TrainConfig, k))]
    log(f"config: preset {cfg.config}" + (f", with {' '.join(differ)}" if differ else "")
        + f" (every value: {cfg.out_dir}/train_config.json once step 1 is done)")
    log(f"world {world} = data parallel {world // cp} x context parallel {cp}; {cfg.seq_len // cp:,} tokens per rank")
    if cfg.eval_only:
        return evaluate_only(cfg, given, cp, world, log)
    run = start_run(cfg, given, cp, world, log)
    s = run.s
    if run.done >= cfg.max_steps:
        log(f"the run in {cfg.out_dir} is complete (step {run.done} of --max_steps {cfg.max_steps}); nothing to do. "
            "Raise --max_steps to train on, or use another --out_dir")
        return 0
    eval_log = open_eval_log(cfg, run.done) if cfg.eval_every else None
    if run.done == 0 and eval_due(cfg, 0):  # the model as it came, before any step
        evaluate(cfg, s, 0, eval_log, log)
    stop = StopRequest()  # from here on a signal ends the run with a checkpoint; before, it ends it at once
    last_save, saved, skipped, zero_norm = time.time(), run.done, 0, 0
    s.model.train()
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
            n_trained, n_pad = step_counts(batch, s.mesh.get_local_rank("cp"), s.device)
            loss, grad_norm, applied, by_position = train_step(s.model, run.opt, batch, n_trained, cfg,
                                                               lr_at(step, cfg, run.lr_anchor))
        if step == run.done + 1:
            if rank == 0:  # the run has started: now its files are written
                run.metrics = rundir.begin(cfg.out_dir, run.done, dataclasses.asdict(cfg), run.launch)
                log.open(os.path.join(cfg.out_dir, "train.log"))
            log(f"time to first step: {time.time() - t_start:.1f} s (start-up, weights, data, first step)")
        log_step(cfg, run, step, loss, by_position, grad_norm, applied, time.time() - t0, world, log, batch,
                 n_trained, n_pad)
        if n_trained:  # a step with nothing to train on is neither a failure nor a dead model
            skipped, zero_norm = (0 if applied else skipped + 1), (zero_norm + 1 if grad_norm == 0 else 0)
        check_health(cfg, step, skipped, zero_norm, log)
        if eval_due(cfg, step):
            evaluate(cfg, s, step, eval_log, log)
        reason = stop.reason()
        timed = cfg.ckpt_every_min > 0 and time.time() - last_save > 60 * cfg.ckpt_every_min
        stopping, timed = parallel.agree([reason is not None, timed], s.device)  # one collective per step
        due = stopping or timed or (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.max_steps
        if due and cfg.checkpoints:
            save_checkpoint(cfg, run, step, log)
            last_save, saved = time.time(), step
        if stopping:
            log(f"stopping after step {step} ({reason or 'another rank was asked to stop'}), with a checkpoint; "
                f"relaunch the same command to continue. Exit code {EXIT_PREEMPTED}")
            run.batches.close()
            return EXIT_PREEMPTED
    run.batches.close()
    if cfg.save_dir:
        export_hf(cfg, s, log)
    return 0


def check_health(cfg: TrainConfig, step: int, skipped: int, zero_norm: int, log):
    if zero_norm == 3:
        log("warning: the gradient norm has been exactly 0 for 3 steps: the model may be dead (a loss flat at "
            "ln(vocab) says so); check --lr and the data")
    if skipped >= cfg.max_skipped_steps:
        raise RankZeroSaid(f"error: {skipped} steps in a row had a non-finite loss or gradient norm (the last at step "
                         f"{step}); they changed no weights. Lower --lr, check the data, or resume from an earlier "
                         "checkpoint")


def peak_memory(cfg: TrainConfig, device) -> float:
    """Peak GPU memory (CPU: max RSS) in bytes, the largest over ranks."""
    peak = torch.tensor([torch.cuda.max_memory_allocated() if cfg.device == "cuda" else
                         resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64,
                        device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def attention_area(batch: list[data.Micro]) -> float:
    """The share of the full causal triangle that a step's attention computes: 1 for one sequence, the sum of
    len^2 over len^2 of the window for packed documents (this rank's windows)."""
    return sum(1.0 if m.doc_lens is None else sum(n * n for n in m.doc_lens) / sum(m.doc_lens) ** 2
               for m in batch) / len(batch)


def log_step(cfg, run: Run, step, loss, by_position, grad_norm, applied, dt, world, log, batch, n_trained, n_pad):
    """One metrics.jsonl row and one printed line."""
    peak = peak_memory(cfg, run.s.device)
    offload = run.s.model.layers[0].offload
    host = offload.host_bytes() if offload is not None else 0
    lr = run.opt.param_groups[0]["lr"]
    flops = run.flops[0] + run.flops[1] * attention_area(batch)
    rec = dict(step=step, loss=loss, grad_norm=grad_norm, num_tokens=n_trained, lr=lr, step_time_s=dt,
               tokens_per_s=run.n_pairs / dt,
               mfu=flops / dt / (world * cfg.peak_tflops * 1e12) if cfg.device == "cuda" else None,
               peak_mem_gib=peak / 2**30, host_pinned_gib=host / 2**30,
               loss_by_position=by_position)  # [--loss_buckets] means over equal spans of position
    if batch[0].doc_lens is not None:  # packed documents: what the windows held
        cp, balanced = run.s.mesh.get_group("cp").size(), cfg.doc_attention == "balanced"
        rec.update(docs=sum(len(m.doc_lens) for m in batch) / len(batch), pad_share=n_pad / run.n_pairs,
                   untrained_share=1 - (n_trained + n_pad) / run.n_pairs, skipped_rows=run.batches.skipped,
                   # the busiest rank's attention over a full causal window's: what plan.py times
                   attn_area=sum(plan.document_area(m.doc_lens, cp, balanced) for m in batch) / len(batch))
    if not applied:
        rec["skipped"] = True
    why = "nothing to train on in these windows" if not n_trained else "non-finite loss or grad norm"
    log(f"step {step:4d} | loss {loss:.4f} | grad norm {grad_norm:.3f} | lr {lr:.2e} | "
        f"{rec['tokens_per_s']:,.0f} tok/s | " + (f"MFU {rec['mfu']:.1%} | " if rec["mfu"] is not None else "")
        + f"{dt:.2f} s | peak mem {rec['peak_mem_gib']:.1f} GiB"
        + (f" | {rec['docs']:.0f} docs, {rec['pad_share']:.1%} padding, {rec['untrained_share']:.1%} untrained"
           if "docs" in rec else "")
        + ("" if applied else f" | SKIPPED: {why}, no weight changed"))
    if run.metrics:
        run.metrics.write(rec)


# ---------------------------------------------------------------------------------------------
# Held-out evaluation: the loss, and the loss by position, on sequences no step trains on
# ---------------------------------------------------------------------------------------------

def eval_due(cfg: TrainConfig, step: int) -> bool:
    return cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.max_steps)


def open_eval_log(cfg: TrainConfig, done: int) -> "rundir.JsonlLog | None":
    """Rank 0: out_dir/eval.jsonl, cut back to the resumed step like metrics.jsonl (an --eval_only run passes
    done = sys.maxsize: it keeps every earlier row and adds its own)."""
    held = {}
    on_rank0(lambda: (os.makedirs(cfg.out_dir, exist_ok=True),
                      held.update(log=rundir.JsonlLog(os.path.join(cfg.out_dir, "eval.jsonl"), done))))
    return held.get("log")


def evaluate(cfg: TrainConfig, s: Setup, step: int, eval_log, log) -> dict:
    """The loss on the first --eval_sequences windows of --eval_data's --eval_split (the same windows at every
    evaluation, so rows compare), overall and over --loss_buckets spans of position. The forward is training's
    (ring attention, chunked loss) under no_grad: no block is recomputed or offloaded, as nothing is kept for a
    backward. Windows are dealt round-robin to the data-parallel groups, so their count rounds up to a multiple
    of data parallel. -> the row written to out_dir/eval.jsonl."""
    t0, dp = time.time(), s.mesh.size(0)
    source = cfg.eval_data or cfg.data
    batches = make_batches(cfg, s, source, cfg.eval_split, 1)
    if cfg.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sums, sequences = PositionSums(cfg.seq_len, cfg.loss_buckets, s.device), 0
    try:
        with torch.no_grad():
            while sequences < cfg.eval_sequences:
                try:
                    [m] = batches.next()
                except data.DataEnd:
                    break
                sums.add(s.model(m.inputs, m.positions, m.labels, loss_chunk=cfg.loss_chunk, doc_lens=m.doc_lens), m)
                sequences += dp
    finally:
        batches.close()
    if sequences == 0:  # the loader reports data shorter than one window per rank itself; this is the rest
        raise SystemExit(f"error: --eval_data {source} (split {cfg.eval_split}) has no window of --seq_len + 1 tokens")
    loss_sum, by_position = sums.reduce()
    n = sums.count()  # the target tokens of every window read, over every rank
    peak = peak_memory(cfg, s.device) if cfg.device == "cuda" else None
    rec = dict(step=step, loss=loss_sum.item() / max(n, 1), loss_by_position=by_position, sequences=sequences, num_tokens=n,
               seq_len=cfg.seq_len, eval_data=source, eval_split=cfg.eval_split, model=cfg.model,
               rope_scaling=s.mcfg.rope_scaling, eval_time_s=time.time() - t0,
               peak_mem_gib=peak / 2**30 if peak is not None else None)
    log(f"eval {step:4d} | loss {rec['loss']:.4f} on {sequences} x {cfg.seq_len:,} tokens | by position: "
        + " ".join("-" if x is None else f"{x:.2f}" for x in by_position) + f" | {rec['eval_time_s']:.1f} s"
        + (f" | peak mem {rec['peak_mem_gib']:.1f} GiB" if peak is not None else ""))
    if eval_log:
        eval_log.write(rec)
    if cfg.retrieval:
        retrieval.run(cfg, s, step, log, plan_shape(cfg, s.mcfg, s.mesh.size()) if cfg.device == "cuda" else None)
    return rec


def evaluate_only(cfg: TrainConfig, given: set, cp: int, world: int, log) -> int:
    """--eval_only true: build --model (with --yarn_factor if given) sharded as for training, evaluate it once
    at --seq_len, add a row (step 0) to out_dir/eval.jsonl. No optimizer, no training data, no checkpoint."""
    s = setup(cfg, given, cp, world, log)
    log(f"eval only: {cfg.model}, rope_scaling {s.mcfg.rope_scaling}, {cfg.eval_sequences} sequence(s) of "
        f"{cfg.seq_len:,} tokens from {cfg.eval_data or cfg.data} ({cfg.eval_split})")
    evaluate(cfg, s, 0, open_eval_log(cfg, sys.maxsize), log)
    return 0


# ---------------------------------------------------------------------------------------------
# Saving: checkpoints and the HF export
# ---------------------------------------------------------------------------------------------

def all_finite(model) -> bool:
    """True on every rank if every rank's weight shards are finite."""
    bad = sum(int((~torch.isfinite(parallel.local_shard(p))).sum()) for p in model.parameters())
    t = torch.tensor([float(bad)], device=next(model.parameters()).device)
    dist.all_reduce(t)
    return t.item() == 0


def save_checkpoint(cfg: TrainConfig, run: Run, step: int, log):
    """A checkpoint of step `step` in out_dir/checkpoints (checkpoint.save), never of non-finite weights."""
    if not all_finite(run.s.model):
        raise SystemExit(f"error: the weights hold non-finite values at step {step}; not saving them. The newest "
                         "checkpoint in out_dir is the last good state")
    t0 = time.time()
    model_sd, optim_sd = get_state_dict(run.s.model, run.opt)
    root = os.path.join(cfg.out_dir, "checkpoints")
    checkpoint.save(root, step, {"model": model_sd, "optim": optim_sd},
                    {"step": step, "data": run.batches.state_dict(), "config": dataclasses.asdict(cfg),
                     "lr_anchor": run.lr_anchor},
                    run.fingerprint, keep=cfg.keep_checkpoints)
    log(f"checkpoint: step {step} saved to {checkpoint.step_dir(root, step)} in {time.time() - t0:.1f} s")


def export_hf(cfg: TrainConfig, s: Setup, log):
    """The HF export (--save_dir): weights + config.json + the tokenizer the run used, written beside the
    folder and renamed into place, so --save_dir is never a mix of two saves."""
    if not all_finite(s.model):
        raise SystemExit("error: the weights hold non-finite values; not exporting them to --save_dir")
    sd = get_model_state_dict(s.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def write():
        final = os.path.abspath(cfg.save_dir)
        tmp = f"{final}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            save_hf(tmp, s.mcfg, sd)
            spec = data.tokenizer_spec(cfg.tokenizer, s.model_path)
            if os.path.isfile(spec):
                shutil.copy(spec, os.path.join(tmp, "tokenizer.json"))
            for f in os.listdir(spec) if os.path.isdir(spec) else []:
                if f.startswith("tokenizer") or f in ("vocab.json", "merges.txt", "generation_config.json"):
                    shutil.copy(os.path.join(spec, f), tmp)
            checkpoint.publish(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log(f"exported HF weights to {cfg.save_dir}")
    on_rank0(write)


@contextlib.contextmanager
def profiled(cfg: TrainConfig, step: int, rank: int, log):
    """Trace step --profile_step with torch.profiler (and, on CUDA, the allocator's event history)."""
    if step != cfg.profile_step:
        yield
        return
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cfg.device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        # 2M events: enough for one Qwen3-8B step at 1M tokens (~1M allocations and frees); each event costs
        # a few hundred bytes of host memory
        torch.cuda.memory._record_memory_history(max_entries=2_000_000)
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


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def main(argv):
    t_start, rank = time.time(), int(os.environ.get("RANK", "0"))
    log = Log(rank)
    try:
        cfg, given = parse_args(argv)
        cp = check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    except SystemExit as e:  # every rank finds the same fault in the flags: rank 0 alone says it
        if rank == 0 and isinstance(e.code, str):
            log.error(e.code)
        elif isinstance(e.code, str):
            time.sleep(QUIET_EXIT_S)
        sys.exit(2 if isinstance(e.code, str) else e.code)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before the first allocation
    watchdog = None
    try:
        rank, world, store = init_distributed(cfg)
        watchdog = Watchdog(store, rank, world, log)
        code = train(cfg, given, cp, rank, world, t_start, log)
    except BaseException as e:
        msg = error_message(e, cfg, cp, rank)
        if watchdog is not None:  # the other ranks may be waiting for this one in a collective
            watchdog.failed(msg or f"rank {rank} failed: {type(e).__name__}: {e}")
        if msg is None:  # a bug: its traceback
            log.error(f"error (rank {rank}): {type(e).__name__}: {e}")
            traceback.print_exc()
        elif rank == 0 or not isinstance(e, RankZeroSaid):
            log.error(msg)
        else:
            time.sleep(QUIET_EXIT_S)
        # Out without tearing the process group down: under NCCL that can wait on a collective that a dead peer
        # never joins. The OS frees the rest.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    watchdog.finished()
    dist.destroy_process_group()
    sys.exit(code)


def error_message(e: BaseException, cfg: TrainConfig, cp: int, rank: int) -> str | None:
    """The one line a rank prints for an error it can explain; None for a bug (which keeps its traceback)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, SystemExit):  # our own messages, already worded for the user
        return str(e.code) if isinstance(e.code, str) else None
    if isinstance(e, (ValueError, OSError)):  # bad input found after start-up (model files, data, disk)
        return f"error (rank {rank}): {type(e).__name__}: {first}"
    if isinstance(e, torch.OutOfMemoryError):
        return (f"error (rank {rank}): out of GPU memory at --seq_len {cfg.seq_len} with --cp {cp} ({first}). Less "
                "memory per GPU: a larger --cp (more GPUs per sequence), --offload true, --tiled_mlp true with a "
                "smaller --mlp_tile, a smaller --loss_chunk, or a shorter --seq_len")
    if isinstance(e, RuntimeError) and peer_failure(e):
        return (f"error (rank {rank}): another rank stopped or hangs ({first[:200]}); see its message. A collective "
                f"waits at most --dist_timeout_min {cfg.dist_timeout_min:g}; relaunch the same command to continue "
                "from the newest checkpoint")
    return None


def peer_failure(e: RuntimeError) -> bool:
    """A collective failed because another rank died (gloo: the connection closed) or past the timeout."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(s in text for s in ("Connection closed by peer", "timed out",
                                                                    "Timed out", "Connection reset by peer"))


if __name__ == "__main__":
    main(sys.argv[1:])
