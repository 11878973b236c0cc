"""The training config: one typed dataclass, named presets, `--key value` overrides, and the checks on them.

    python train.py --help                  # every flag, its default and what it does
    python train.py --config demo --help    # the same with the demo preset's values
    python -m pytest tests/test_train.py tests/e2e/test_train.py -q

Every field of TrainConfig is a flag; its help is the field's metadata, so --help and the code cannot disagree.
"""
import dataclasses
import difflib
import os
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import torch

import data
from million import hf
from million import lora
from million import packing
from million import retrieval


def flag(default, help: str, heading: str = ""):
    """A TrainConfig field: its default, the line --help prints for it, and a heading printed above it."""
    return dataclasses.field(default=default, metadata={"help": help, "heading": heading})


@dataclass
class TrainConfig:
    config: str = flag("qwen3-8b-1m", "the preset these values started from")
    model: str = flag("Qwen/Qwen3-8B", "a folder or hub id with config.json (+ *.safetensors: weights; without: "
                      "random init), or tiny", heading="the model")
    tokenizer: str = flag("", '"" = the model\'s tokenizer.json; byte = bytes + end-of-text')
    yarn_factor: float = flag(32.0, "0 = keep the checkpoint's RoPE; theta always comes from the checkpoint")
    yarn_original_max_position_embeddings: int = flag(32768, "the context length YaRN stretches from")
    data: str = flag("pg19", "pg19 (streamed from the hub), synthetic, or a local .txt/.jsonl/.parquet file or "
                     "folder", heading="the data")
    data_repo: str = flag("", '"" = data.py\'s default PG-19 parquet copy (--data pg19)')
    data_revision: str = flag("main", "the hub revision of --data_repo")
    data_split: str = flag("train", "the split trained on (files named split-*, or in a folder split/)")
    data_column: str = flag("text", "the field of a .jsonl/.parquet row that holds the text")
    packing: str = flag("auto", "concat: texts end to end, attending across (PG-19) | docs: each document attends "
                        "to itself alone | auto: concat for text rows, docs for the others",
                        heading='rows: {"text"}, {"messages": [...]} or {"prompt", "completion"} (chat.py); '
                                "conversations use the chat template of the tokenizer's folder")
    doc_attention: str = flag("balanced", "docs: balanced (chunks dealt to ranks by the mask's area; FA4 runs a "
                              "rank's documents in one call) | simple (zigzag, a call per document piece; slower)")
    assistant_only_loss: bool = flag(True, "messages rows: train on the assistant's turns only")
    chat_template: str = flag("", "a .jinja file rendering messages rows; \"\" = the tokenizer folder's "
                                  "(chat_template.jinja or tokenizer_config.json)")
    completion_only_loss: bool = flag(True, "prompt/completion rows: train on the completion only")
    seq_len: int = flag(1_048_576, "tokens per sequence", heading="the step")
    cp: int = flag(0, "context-parallel degree; 0 = the world size. Data parallel = world / cp")
    grad_accum: int = flag(1, "sequences per rank group per optimizer step")
    max_steps: int = flag(20, "optimizer steps in the run")
    lr: float = flag(1e-5, "the peak learning rate")
    min_lr_ratio: float = flag(0.1, "cosine decays to lr * min_lr_ratio at max_steps")
    warmup_steps: int = flag(2, "linear warmup from 0 to lr")
    weight_decay: float = flag(0.0, "AdamW's decoupled weight decay")
    beta1: float = flag(0.9, "AdamW's first-moment decay")
    beta2: float = flag(0.95, "AdamW's second-moment decay")
    grad_clip: float = flag(1.0, "the global gradient norm is clipped to this; 0 = no clipping (it is still logged)")
    seed: int = flag(0, "the random init and the synthetic corpus")
    device: str = flag("cuda", "cuda | cpu")
    dtype: str = flag("bfloat16", "compute: activations, and the weights as gathered for compute")
    param_dtype: str = flag("float32", "the sharded weights, their gradients and AdamW states (and --save_dir's "
                            "files). bfloat16 halves their memory, but an AdamW update below bf16's resolution "
                            "(~1/256 of the weight) is lost: at lr 1e-5 most weights would never move, unless "
                            "--stochastic_rounding true")
    stochastic_rounding: bool = flag(False, "with --param_dtype bfloat16: updates computed in fp32, rounded to bf16 "
                                     "at random (optim.py): small updates kept on average, 8 bytes per parameter")
    attn_backend: str = flag("auto", "auto | fa4 | cudnn | flash: the CUDA attention kernels (kernels.py)")
    deltanet_kernel: str = flag("auto", "auto | fla | torch: Qwen3.5's Gated DeltaNet kernels (deltanet.py); auto "
                                "takes fla where it runs (a CUDA GPU, fla-core, Triton >= 3.7.1 on Hopper)")
    fit: str = flag("auto", "auto: the fastest levers predicted to fit this node (plan.py) | off: as given",
                    heading="memory levers (model.py, section 2). With --fit auto, plan.py sets those not given on "
                            "the command line")
    gpu_mem_gib: float = flag(0.0, "GPU memory per rank the plan may use (0 = what is free on the GPU now)")
    host_mem_gib: float = flag(0.0, "host memory per node the plan may use (0 = RAM, or the cgroup's limit)")
    recompute: bool = flag(True, "recompute each block in backward, keeping only its input")
    offload: bool = flag(True, "keep what is kept in pinned host memory")
    offload_layers: int = flag(-1, "offload only the first N blocks' tensors (-1 = all): when host RAM is short")
    keep_attention: bool = flag(True, "keep attention's output + lse instead of recomputing attention in backward")
    keep_attention_layers: int = flag(-1, "keep it for the first N blocks only (-1 = all): the most time per host "
                                      "byte")
    keep_mlp_layers: int = flag(0, "LoRA: the last N blocks (-1 = all) keep their MLP's gate and up outputs on "
                                "the GPU for the backward, which then skips those GEMMs (--fit auto: as many as "
                                "the GPU memory left holds)")
    tiled_mlp: bool = flag(True, "compute the MLP in sequence tiles of mlp_tile rows")
    # 16384: the largest tile that does not raise the step's peak memory (bench/NOTES.md, mlp_tile)
    mlp_tile: int = flag(16384, "rows per MLP tile")
    deltanet_tile: int = flag(0, "Qwen3.5, one device (cp 1): each DeltaNet layer over pieces of N tokens, each "
                              "recomputed in the backward, which then holds one piece's intermediates (0 = whole)")
    # 2048: a few % slower than 4096 for less memory (bench/NOTES.md, config.py)
    loss_chunk: int = flag(2048, "rows of the chunked loss")
    peak_tflops: float = flag(989.0, "per GPU, dense bf16 (H100/H200 SXM), for MFU")
    out_dir: str = flag("runs/qwen3-8b-1m", "the run's folder: metrics.jsonl, train.log, checkpoints/",
                        heading="the run: its folder, checkpoints, resume, the HF export")
    checkpoints: bool = flag(True, "false: never write a checkpoint (benchmarks, throwaway runs)")
    ckpt_every: int = flag(0, "a checkpoint every N steps (0 = by time only); always one at the end")
    ckpt_every_min: float = flag(30.0, "... and one when this many minutes have passed since the last (0 = off)")
    keep_checkpoints: int = flag(2, "the newest K are kept; older ones are deleted once a newer one is complete")
    resume: str = flag("auto", "auto: continue from out_dir's newest checkpoint if any | none | a checkpoint folder")
    overwrite: bool = flag(False, "with --resume none: allow replacing an earlier run's files in out_dir")
    save_dir: str = flag("", '"" = no export; else an HF-format folder (weights, config, tokenizer) at the end')
    max_skipped_steps: int = flag(3, "stop after this many steps in a row with a non-finite loss or gradient norm")
    dist_timeout_min: float = flag(30.0, "a collective (or start-up) waiting longer than this stops the run")
    profile_step: int = flag(0, ">0: trace this step with torch.profiler (+ CUDA memory history) into "
                             "out_dir/profile/; bench/profile_step.py summarises it. The step runs slower")
    loss_buckets: int = flag(16, "the mean loss over this many equal spans of the sequence's global positions",
                             heading="loss by position (every step, in metrics.jsonl) and held-out evaluation "
                                     "(out_dir/eval.jsonl)")
    eval_every: int = flag(0, "evaluate before the first step, every N steps and after the last; 0 = never")
    eval_only: bool = flag(False, "evaluate --model (with --yarn_factor, at --seq_len) once and stop: no training, "
                           "no checkpoint; a row is added to out_dir/eval.jsonl")
    eval_data: str = flag("", '"" = --data\'s --eval_split (synthetic: books no training stream reaches)')
    eval_split: str = flag("validation", "the split evaluated on")
    eval_sequences: int = flag(2, "held-out sequences of --seq_len tokens per evaluation (the same ones each time)")
    retrieval: bool = flag(False, "needle-in-a-haystack retrieval with each evaluation: out_dir/retrieval.jsonl "
                           "and retrieval.png", heading="retrieval (retrieval.py)")
    retrieval_lengths: str = flag("", "window lengths in tokens, comma-separated; \"\" = --seq_len")
    retrieval_depths: str = flag("0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1",
                                 "where the needles sit: fractions of the haystack")
    retrieval_keys: int = flag(4, "needles per (length, depth)")
    retrieval_needles: int = flag(0, "needles per window at most (one per depth); 0 = as many as fit in a quarter")
    retrieval_data: str = flag("", "the haystack's text (its --eval_split); \"\" = --eval_data, else --data")
    retrieval_chat: str = flag("auto", "true: rendered through the chat template | false: plain text | auto: true "
                                       "when --packing is docs and the tokenizer has a chat template")
    lora_rank: int = flag(0, "0 = full fine-tune; r > 0: adapters A [r, in], B [out, r] beside each target",
                          heading="LoRA and QLoRA (lora.py): the model frozen in --dtype, adapters trained in "
                                  "--param_dtype")
    lora_alpha: float = flag(0.0, "the adapters' scale is alpha / r; 0 = 2 x lora_rank (PEFT's default is 8)")
    lora_targets: str = flag("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                             "the projections adapted (Qwen3.5's DeltaNet: in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,"
                             "out_proj; a mixture of experts' routed experts: experts)")
    quantize: str = flag("", "nf4: the frozen projections and experts in 4-bit NormalFloat (QLoRA; needs torchao)")
    merge_lora: bool = flag(False, "--save_dir: false = a PEFT adapter folder; true = the merged HF model")


PRESETS = {
    "qwen3-8b-1m": {},
    # the loss falls from 5.5 (uniform over 257 bytes) to ~2.4
    "demo": dict(model="tiny", tokenizer="byte", yarn_factor=0.0, data="synthetic", seq_len=4096, max_steps=150,
                 lr=3e-3, warmup_steps=10, weight_decay=0.0, device="cpu", dtype="float32", offload=False,
                 tiled_mlp=False, loss_chunk=512, out_dir="runs/demo",
                 # the byte tokenizer has no chat template: conversations (--data examples/chat.jsonl) use Qwen3's
                 chat_template=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                                            "qwen3_chat_template.jinja")),
}

# Flags a resumed run must keep: they define what the checkpoint holds (model, data stream, state dtype). The
# rest may change on resume (--max_steps, --lr, levers, checkpoint and eval cadence, ...), each named in the log.
FIXED_ON_RESUME = ("model", "tokenizer", "yarn_factor", "yarn_original_max_position_embeddings", "data",
                   "data_repo", "data_revision", "data_split", "data_column", "packing", "seq_len", "seed",
                   "param_dtype", "lora_rank", "lora_alpha", "lora_targets", "quantize")

def parse_args(argv) -> tuple[TrainConfig, set]:
    """--config NAME picks a preset; every other --key value overrides one field. -> (config, the fields given
    on the command line: levers given there win over --fit auto's plan)."""
    if "-h" in argv or "--help" in argv:
        at = argv.index("--config") + 1 if "--config" in argv else len(argv)
        name = argv[at] if at < len(argv) and argv[at] in PRESETS else TrainConfig.config
        if os.environ.get("RANK", "0") == "0":
            print(flag_help(TrainConfig(**{**PRESETS[name], "config": name})))
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


def spelled(value) -> str:
    """A value as the command line spells it."""
    if isinstance(value, bool):
        return str(value).lower()
    return '""' if value == "" else str(value)


def flag_help(cfg: TrainConfig) -> str:
    """`--help`: every flag with its value in cfg (a preset's) and its help."""
    out = [f"usage: torchrun --nproc_per_node N train.py [--config PRESET] [--key value ...]; presets: "
           f"{', '.join(PRESETS)} (shown: {cfg.config})"]
    for f in dataclasses.fields(TrainConfig):
        if f.metadata["heading"]:
            out.append(f"# {f.metadata['heading']}")
        out.append(f"  --{f.name} {spelled(getattr(cfg, f.name))}  # {f.metadata['help']}")
    return "\n".join(out)


def summary(cfg: TrainConfig) -> str:
    """The preset and the flags whose values differ from it, for the log's config line."""
    preset = PRESETS[cfg.config]
    differ = [f"--{k} {spelled(v)}" for k, v in dataclasses.asdict(cfg).items()
              if k != "config" and v != preset.get(k, getattr(TrainConfig, k))]
    return f"preset {cfg.config}" + (f", with {' '.join(differ)}" if differ else "")


def context_parallel(cfg: TrainConfig, world: int) -> int:
    """The context-parallel degree: --cp, or the world size for --cp 0."""
    return cfg.cp or world


def packs_documents(cfg: TrainConfig) -> bool:
    """Whether this run may pack documents: --packing docs, or auto where --data or --eval_data is not known to be
    text without reading it (packing.py then reads each source's first file). The ring's schedule and the attention
    kernels are chosen by it, before any data is read."""
    sources = [s for s in (cfg.data, cfg.eval_data) if s]
    return cfg.packing == "docs" or (cfg.packing == "auto"
                                     and not all(data.known_text(s, cfg.data_repo) for s in sources))


def check_model(cfg: TrainConfig, mcfg):
    """The flags that need the model's config (mcfg, as read): --lora_targets against its blocks. A local folder's
    are refused before start-up (check_config); a hub id's once it is downloaded, by rank 0 for every rank
    (train.model_config). Raises SystemExit with one line."""
    why = cfg.lora_rank and lora.moe_targets_error(mcfg, lora.parse_targets(cfg.lora_targets))
    if why:
        raise SystemExit(f"error: {why}")


def check_config(cfg: TrainConfig, world: int):
    """Everything that can be said about the flags before any work starts (the same on every rank)."""
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
    need(cfg.packing in ("auto", *packing.PACKINGS), f"--packing {cfg.packing}: use auto, concat or docs")
    need(not cfg.chat_template or os.path.isfile(cfg.chat_template),
         f"--chat_template {cfg.chat_template}: no such file (a .jinja chat template; \"\" = the tokenizer's)")
    need(cfg.doc_attention in ("balanced", "simple"),
         f"--doc_attention {cfg.doc_attention}: use balanced or simple")
    need(cfg.gpu_mem_gib >= 0 and cfg.host_mem_gib >= 0, "--gpu_mem_gib and --host_mem_gib must be >= 0")
    need(cfg.offload_layers >= -1 and cfg.keep_attention_layers >= -1 and cfg.keep_mlp_layers >= -1,
         "--offload_layers, --keep_attention_layers and --keep_mlp_layers count blocks: 0 or more, or -1 for every "
         "block")
    need(not cfg.keep_mlp_layers or cfg.lora_rank, "--keep_mlp_layers is a LoRA lever (lora.py): give --lora_rank, "
         "or leave it 0")
    need(cfg.attn_backend in ("auto", "fa4", "cudnn", "flash"),
         f"--attn_backend {cfg.attn_backend}: use auto, fa4, cudnn or flash")
    if cfg.attn_backend == "fa4":  # said here once, not by every rank as it builds the ring
        from million import kernels
        need(not kernels.fa4_unavailable(), f"--attn_backend fa4: {kernels.fa4_unavailable()}; install it with "
             "`pip install flash-attn-4` (sm90+ GPUs) or use --attn_backend auto")
    need(cfg.deltanet_tile >= 0, f"--deltanet_tile {cfg.deltanet_tile}: tokens per piece, >= 0 (0 = off)")
    need(cfg.deltanet_kernel in ("auto", "fla", "torch"),
         f"--deltanet_kernel {cfg.deltanet_kernel}: use auto, fla or torch")
    need(cfg.cp >= 0, f"--cp {cfg.cp}: must be >= 1 (or 0 for the world size)")
    cp = context_parallel(cfg, world)
    need(world % cp == 0, f"--cp {cp} does not divide the world size {world}; data parallel = world / cp")
    need(not cfg.deltanet_tile or cp == 1, f"--deltanet_tile {cfg.deltanet_tile} needs --cp 1 (one device a "
         "sequence): under context parallelism the DeltaNet state comes from the ranks' span summaries")
    need(cfg.seq_len > 0 and cfg.seq_len % (2 * cp) == 0,
         f"--seq_len {cfg.seq_len} must be a positive multiple of 2*cp = {2 * cp} (zigzag sharding cuts the "
         f"sequence into 2*cp equal chunks); e.g. --seq_len {max(2 * cp, cfg.seq_len // (2 * cp) * 2 * cp)}")
    for key in ("grad_accum", "max_steps", "loss_chunk", "keep_checkpoints", "max_skipped_steps"):
        need(getattr(cfg, key) >= 1, f"--{key} {getattr(cfg, key)}: must be >= 1")
    need(cfg.lr > 0, f"--lr {cfg.lr}: must be > 0")
    need(0 <= cfg.min_lr_ratio <= 1, f"--min_lr_ratio {cfg.min_lr_ratio}: must lie in 0..1 (of --lr)")
    for key in ("warmup_steps", "ckpt_every", "ckpt_every_min"):
        need(getattr(cfg, key) >= 0, f"--{key} {getattr(cfg, key)}: must be >= 0")
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
    need(not cfg.retrieval or cfg.eval_every or cfg.eval_only, "--retrieval true runs with each evaluation: "
         "set --eval_every N or --eval_only true")
    need(cfg.retrieval_chat in ("auto", "true", "false"), f"--retrieval_chat {cfg.retrieval_chat}: auto, true or false")
    try:
        retrieval.parse_grid(cfg.retrieval_lengths, cfg.retrieval_depths, cfg.retrieval_keys, cfg.retrieval_needles,
                             cfg.seq_len, context_parallel(cfg, world))
    except ValueError as e:
        need(False, str(e))
    lora_error = lora.check_flags(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.quantize, cfg.merge_lora)
    need(lora_error is None, lora_error)
    kind = hf.model_type(cfg.model) if os.path.isdir(cfg.model) else ""  # a hub id's: once it is downloaded
    if kind.startswith("qwen3_5"):  # Qwen3.5
        from million import qwen3_5
        why = qwen3_5.check_flags(cfg, context_parallel(cfg, world))
        need(why is None, why)
    if cfg.model == "tiny" or kind in ("qwen3", "qwen3_moe") or kind.startswith("qwen3_5"):  # a stand-in for the
        # config, which the loader reads (and reports if it is broken): experts or not, DeltaNet layers or not
        check_model(cfg, SimpleNamespace(num_experts=int("moe" in kind), layer_types=kind.startswith("qwen3_5")))
    need(not (cfg.eval_every and not cfg.eval_only and not cfg.eval_data and os.path.isfile(cfg.data)),
         f"--data {cfg.data} is one file: it has no held-out split to evaluate on; pass --eval_data (a file or "
         "folder of books not trained on)")
