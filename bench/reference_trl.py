"""The public TRL long-context recipe, run at our benchmark shapes, so train.py can be compared with it.

What it runs: TRL's "Training Beyond 1M Tokens" recipe (docs/source/long_context_training.md and
examples/sft_qwen3_8b_1m_context/ in huggingface/trl; Qwen3-8B at 1,048,576 tokens on 8xH100: 380 s/step,
56.2 GB/GPU), with its settings given here in code instead of an accelerate YAML:

- `trl.SFTTrainer` on `transformers.Qwen3ForCausalLM` built from bench/configs/<model>/config.json (random init,
  no weights), attention "sdpa" (the only one accelerate's context parallelism takes); or, for a Qwen3.5 config
  (qwen3_5_text, or qwen3_5's text_config), `Qwen3_5ForCausalLM` on one GPU, its DeltaNet layers on fla's kernels
  where fla imports (the JSON's versions say): no CP, which TRL refuses for this model;
- FSDP2 (`fsdp_config` version 2, TRANSFORMER_BASED_WRAP of Qwen3DecoderLayer, reshard after forward) and context
  parallelism (`accelerate.ParallelismConfig(cp_size=--cp)`: torch's experimental `context_parallel`, the
  sequence split over the cp ranks with load balancing, K/V all-gathered, "allgather" rotation);
- gradient checkpointing of every decoder layer with `gradient_checkpointing_kwargs={"offload": True}` (each
  layer's saved input in pinned host memory; transformers >= 5.16), as the recipe (not FSDP's own activation
  checkpointing, which cannot offload and which transformers refuses together with gradient checkpointing);
- YaRN through `rope_parameters` (rope_type "yarn", factor --yarn_factor, original_max_position_embeddings
  32768, theta from the config): train.py's defaults, which are the recipe's (factor 32 whatever the length).
  max_position_embeddings = factor x 32768 (never below --seq_len): transformers warns unless the two agree, and
  the frequencies use the factor either way. The JSON's rope_vs_model_py compares them with model.py's;
- bf16: --param_dtype float32 (default, as train.py) is `bf16=True`, i.e. accelerate's mixed precision, under
  which FSDP2 keeps fp32 master weights and AdamW states and gathers bf16 for compute (accelerate upcasts any
  bf16 weights to fp32 when mixed precision is on: the recipe, which loads the model in bf16, trains this way too).
  --param_dtype bfloat16 builds the model in bf16 with `bf16=False`: bf16 weights, gradients and AdamW states,
  as train.py's --param_dtype bfloat16;
- TRL's default loss: in trl 1.16 `loss_type="nll"` (the former "chunked_nll") runs a fused LM head
  (trl.kernels.chunked_logprob): the head projects 4096-token x 32768-vocab tiles, a Triton kernel folds each
  tile into an online log-sum-exp, gradients accumulate in fp32, and the [tokens x vocab] logits never exist.
  Under CP each rank scores its own shard of the pre-shifted labels; the loss is the global token mean;
- data: one synthetic sequence of exactly --seq_len tokens per step (numpy's seeded RNG, uniform over the
  vocabulary: the loss stays near ln(vocab)), per_device_train_batch_size 1, no grad accumulation, no packing
  (CP refuses it), pad_to_multiple_of 2*cp (a no-op here: --seq_len must divide by 2*cp), AdamW and the rest
  at TRL's defaults (lr 2e-5, linear decay, fused AdamW, grad clip 1.0), no eval, no saving, report_to none.

Measured, as train.py measures: each step's wall time between torch.cuda.synchronize() calls at step begin and
end (a TrainerCallback); s/step = the median of the steps after the first; time to first step from process
start; peak GPU memory = torch.cuda.max_memory_allocated() in GiB (2^30), reset at each step's begin, the max
over ranks and steps (train.py's peak_mem_gib); pinned host memory in use at its peak (torch's host allocator,
where torch reports it: blocks rounded up to powers of two); the logged loss and grad norm; MFU as train.py counts.
Rank 0 prints one line per step and writes one JSON (after every step, so a run cut short keeps its steps).
Written against trl 1.16.0, transformers 5.17.0 and accelerate 1.15.0. Run on 2 x H200 (torch 2.11, CUDA 13) at
262,144 tokens, cp 2, fp32 master weights: Qwen3-8B 103.6 s/step, peak 95.9 GiB; Qwen3-1.7B 39.0 s/step, peak
31.4 GiB (bench/results/reference_trl_*.json; the comparison with train.py is in bench/RESULTS.md).

    # 2 x H200 (the comparison in bench/RESULTS.md; then train.py at the same shapes, the same param dtype):
    torchrun --standalone --nproc_per_node 2 bench/reference_trl.py --model bench/configs/qwen3-1.7b \\
        --seq_len 262144 --cp 2 --steps 3 --out bench/results/reference_trl_1.7b_262k.json
    torchrun --standalone --nproc_per_node 2 bench/reference_trl.py --model bench/configs/qwen3-8b \\
        --seq_len 262144 --cp 2 --steps 3 --out bench/results/reference_trl_8b_262k.json
    torchrun --standalone --nproc_per_node 2 train.py --model bench/configs/qwen3-8b --seq_len 262144 --cp 2 \\
        --tokenizer byte --data synthetic --max_steps 3 --checkpoints false --out_dir /tmp/ours_8b_262k
    # one H200, PEFT LoRA r 16 on every linear beside train.py's --lora_rank 16 (bench/RESULTS.md, LoRA):
    python bench/reference_trl.py --model bench/configs/qwen3-8b --seq_len 131072 --cp 1 --steps 2 --lora_rank 16 \\
        --out bench/results/reference_trl_peft_8b_131k.json
    # one H200, Qwen3.5's 9B shape (one GPU: TRL refuses CP for it), PEFT LoRA r 16, fla's kernels on the path
    # (bench/gpu_wheels.sh; transformers takes them when fla imports), beside bench/qwen3_5_gpu.sh's lora:131072:
    python bench/reference_trl.py --model bench/configs/qwen3_5-9b --seq_len 131072 --cp 1 --steps 2 \\
        --lora_rank 16 --yarn_factor 0 --out bench/results/reference_trl_peft_q35_131k.json
    # the wiring on a CPU (no FSDP2, no CP: both need CUDA), a 2-layer Qwen3 of hidden 64:
    python bench/reference_trl.py --model tiny --seq_len 256 --cp 1 --steps 2 --device cpu --out /tmp/ref_tiny.json

Its extra packages are for this benchmark only (not in requirements.txt):

    pip install trl==1.16.0 datasets==5.2.0 accelerate==1.15.0     # + transformers>=5.16 (written for 5.17.0)

On a GPU machine without a package index that has torch, transformers 5.17 and accelerate 1.15 but not trl,
datasets, dill or multiprocess (their other requirements, pyarrow, pandas, xxhash, fsspec, huggingface-hub,
jinja2, psutil, ... are there): fetch the four wheels (~1.8 MB) here, carry .whl/trl, install them there:

    bash bench/trl_wheels.sh download                 # here: .whl/trl/*.whl (git-ignored)
    bash bench/trl_wheels.sh install                  # there: into /tmp/trlsite, then
    export PYTHONPATH=/tmp/trlsite:$PYTHONPATH
"""
import time

T_START = time.time()  # "time to first step" counts from here, as train.py counts from its start

import argparse
import importlib.util
import json
import os
import resource
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PINS = {"trl": "1.16.0", "datasets": "5.2.0", "accelerate": "1.15.0"}
INSTALL = ("pip install " + " ".join(f"{k}=={v}" for k, v in PINS.items())
           + " (benchmark only; on the offline GPU machine: bash bench/trl_wheels.sh install)")
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=4096,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, model_type="qwen3")
PEAK_TFLOPS = 989.0  # dense bf16 per GPU (H100/H200 SXM), train.py's --peak_tflops


def fail(msg: str):
    """One line on rank 0 (every check here fails alike on every rank), exit code 2 everywhere."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "bench", "configs", "qwen3-1.7b"),
                    help="a folder with an HF Qwen3 config.json (weights are drawn, not read), or 'tiny'")
    ap.add_argument("--seq_len", type=int, default=262144, help="tokens per sequence (one per step per dp rank)")
    ap.add_argument("--cp", type=int, default=0, help="context-parallel size (0: the world size)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--param_dtype", choices=["float32", "bfloat16"], default="float32",
                    help="float32: bf16 mixed precision over fp32 master weights (train.py's default); "
                         "bfloat16: bf16 weights, gradients and AdamW states")
    ap.add_argument("--yarn_factor", type=float, default=32.0, help="0 keeps the config's RoPE (train.py's flag)")
    ap.add_argument("--yarn_original_max_position_embeddings", type=int, default=32768)
    ap.add_argument("--sdpa_backend", choices=["auto", "flash", "efficient", "cudnn"], default="auto",
                    help="auto: torch chooses (the recipe); else only this SDPA kernel")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--lora_rank", type=int, default=0,
                    help="> 0: PEFT LoRA of this rank on every linear but the head ('all-linear', no dropout), the "
                         "base frozen in bf16 (--param_dtype is then ignored), as train.py's --lora_rank")
    ap.add_argument("--lora_alpha", type=float, default=0.0, help="0 = 2 x --lora_rank (train.py's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "reference_trl.json"))
    a = ap.parse_args()
    if a.steps < 1:
        fail("--steps must be >= 1")
    if a.lora_rank < 0 or a.lora_alpha < 0:
        fail("--lora_rank and --lora_alpha must be >= 0")
    if a.lora_rank:
        a.param_dtype = "bfloat16"  # the frozen base; the adapters are fp32 (PEFT's autocast_adapter_dtype)
    return a


def import_extras(a):
    """The benchmark's extra packages, or one line saying how to get them."""
    try:
        import accelerate, datasets, numpy, torch, transformers, trl  # noqa: F401
        from accelerate import ParallelismConfig  # noqa: F401  (accelerate >= 1.10)
    except ImportError as e:
        fail(f"{e.name or e} is missing or too old: {INSTALL}")
    if a.lora_rank and not importlib.util.find_spec("peft"):
        fail("--lora_rank needs peft: pip install peft (a test-only requirement of this project)")
    import inspect
    if "offload" not in inspect.signature(transformers.PreTrainedModel.gradient_checkpointing_enable).parameters:
        fail(f"transformers {transformers.__version__} has no gradient checkpointing offload: "
             f"pip install transformers>=5.16 (written for 5.17.0)")
    packages = ("torch", "transformers", "trl", "accelerate", "datasets", "peft", "fla", "triton")  # fla: Qwen3.5's
    return {m: __import__(m).__version__ for m in packages if importlib.util.find_spec(m)}          # DeltaNet kernels


def hf_config(a, transformers):
    """The Qwen3Config (or Qwen3_5TextConfig: the hybrid, one GPU) the run trains: the config.json's shape, YaRN as
    train.py applies it."""
    if a.model == "tiny":
        d = dict(TINY)
    else:
        f = os.path.join(a.model, "config.json")
        if not os.path.isfile(f):
            fail(f"no config.json in {a.model!r}: pass a folder such as bench/configs/qwen3-8b, or 'tiny'")
        with open(f) as fh:
            d = json.load(fh)
    if d.get("model_type") == "qwen3_5":  # the vision-language checkpoint: its text decoder is what trains
        d = dict(d["text_config"], model_type="qwen3_5_text")
    hybrid = d.get("model_type") == "qwen3_5_text"
    if d.get("model_type") != "qwen3" and not hybrid:
        fail(f"{a.model}: model_type {d.get('model_type')!r}, expected 'qwen3' or 'qwen3_5_text' (Qwen3.5)")
    old = d.pop("rope_parameters", None) or d.pop("rope_scaling", None) or {}
    d.pop("rope_scaling", None)
    theta = float(old.get("rope_theta", d.pop("rope_theta", 10000.0)))
    d.pop("rope_theta", None)
    for k in ("torch_dtype", "dtype", "transformers_version", "use_cache"):
        d.pop(k, None)
    if a.yarn_factor:
        if a.yarn_factor < 1:
            fail("--yarn_factor must be 0 (off) or >= 1")
        rope = {"rope_type": "yarn", "rope_theta": theta, "factor": float(a.yarn_factor),
                "original_max_position_embeddings": a.yarn_original_max_position_embeddings}
        rope.update({k: old[k] for k in ("beta_fast", "beta_slow") if old.get(k) is not None})  # as model.py keeps
        rope.update({k: old[k] for k in ("partial_rotary_factor", "mrope_section", "mrope_interleaved") if k in old})
        # transformers checks factor == max_position_embeddings / original; give it that length (the factor is what
        # the frequencies use either way), never less than the sequence
        d["max_position_embeddings"] = max(a.seq_len, round(a.yarn_factor * a.yarn_original_max_position_embeddings))
    else:
        rope = dict(old)
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope["rope_theta"] = theta
        d["max_position_embeddings"] = max(a.seq_len, d.get("max_position_embeddings", 0))
    mixers = {"full_attention", "linear_attention"} if hybrid else {"full_attention"}
    if d.get("use_sliding_window") or not set(d.get("layer_types") or ["full_attention"]) <= mixers:
        fail(f"{a.model}: sliding-window layers; context parallelism takes full causal attention only")
    d["rope_parameters"] = rope
    d["use_cache"] = False
    return (transformers.Qwen3_5TextConfig if hybrid else transformers.Qwen3Config)(**d)


def rope_vs_ours(model, cfg) -> dict:
    """transformers' YaRN frequencies against model.py's (train.py's), for the JSON: the two runs' RoPE agree."""
    if cfg.model_type == "qwen3_5_text":
        return {"note": "Qwen3.5: partial rotary, checked against transformers in tests/test_qwen3_5.py"}
    try:
        sys.path.insert(0, ROOT)
        import model as ours
    except Exception as e:  # noqa: BLE001 - a comparison, not a requirement
        return {"error": f"model.py not importable: {e}"}
    finally:
        sys.path.remove(ROOT)
    rope = cfg.rope_parameters
    scaling = None
    if rope.get("rope_type") == "yarn":
        scaling = {k: rope[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
                   if k in rope}
    oc = ours.Qwen3Config(head_dim=cfg.head_dim, rope_theta=rope["rope_theta"], rope_scaling=scaling)
    inv, factor = ours.rope_inv_freq(oc)
    rot = model.model.rotary_emb
    hf = rot.inv_freq.detach().double().cpu()
    return {"max_rel_diff_inv_freq": float(((hf - inv) / inv).abs().max()),
            "attention_factor_hf": float(rot.attention_scaling), "attention_factor_ours": float(factor)}


def step_flops(a, cfg, seq_len: int) -> float:
    """Useful FLOPs of one sequence (fwd + bwd, no recompute): the count train.py's step_flops makes (for Qwen3.5,
    plan.py's own, which train.py uses: attention in the full-attention layers only)."""
    if cfg.model_type == "qwen3_5_text":
        sys.path.insert(0, ROOT)
        try:
            from million import plan, qwen3_5
            return plan.useful_flops(plan.Shape.of(qwen3_5.read_config(a.model), seq_len, 1, 1, 1))
        finally:
            sys.path.remove(ROOT)
    h, i, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    qd, kvd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    params = n * (2 * h * qd + 2 * h * kvd + 3 * h * i) + h * cfg.vocab_size
    return 6 * params * seq_len + n * 3 * 2 * 2 * qd * seq_len * seq_len / 2


def tiny_tokenizer(cfg, transformers):
    """SFTTrainer wants a tokenizer (for pad/eos ids) even for tokenized data: a two-word one, offline."""
    from tokenizers import Tokenizer, models
    pad_id = cfg.bos_token_id if cfg.bos_token_id is not None else 0
    eos_id = cfg.eos_token_id if cfg.eos_token_id is not None else pad_id
    pad, eos = "<|endoftext|>", ("<|im_end|>" if eos_id != pad_id else "<|endoftext|>")
    tok = Tokenizer(models.WordLevel(vocab={pad: pad_id, eos: eos_id}, unk_token=pad))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, bos_token=pad, eos_token=eos)


def main():
    a = parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cp = a.cp or world
    if world % cp:
        fail(f"--cp {cp} does not divide the {world} processes")
    if a.seq_len < 2 or a.seq_len % (2 * cp):
        fail(f"--seq_len {a.seq_len} is not a multiple of 2*cp = {2 * cp} (context parallelism splits each "
             f"sequence into 2*cp chunks); try {max(2 * cp, a.seq_len // (2 * cp) * 2 * cp)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub; the GPU machine has no network
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    versions = import_extras(a)
    import numpy as np
    import torch
    import torch.distributed as dist
    import transformers
    from accelerate import ParallelismConfig
    import datasets
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but torch sees no GPU")
    if device == "cpu" and cp > 1:
        if rank == 0:
            print(f"note: --device cpu: no context parallelism (torch's needs CUDA SDPA kernels) and no FSDP2 "
                  f"(accelerate shards only GPU-type devices), no checkpointing offload (pinned memory); running cp 1 "
                  f"{'DDP' if world > 1 else 'plain'} to check the wiring", flush=True)
        cp = 1
    elif device == "cpu" and rank == 0:
        print("note: --device cpu: no FSDP2, no context parallelism, no checkpointing offload (all need CUDA); "
              "checking the wiring only", flush=True)
    dp = world // cp
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    log = (lambda *s: print(*s, flush=True)) if rank == 0 else (lambda *s: None)

    # the model: the same draw on every rank (so no broadcast is needed), built on the device it trains on
    cfg = hf_config(a, transformers)
    if cfg.model_type == "qwen3_5_text" and world > 1:
        fail("Qwen3.5 runs on one GPU here: accelerate's context parallelism takes full causal attention only, and "
             "TRL refuses it for this model")
    pdtype = getattr(torch, a.param_dtype)
    transformers.set_seed(a.seed)
    t0 = time.time()
    with torch.device("cuda" if device == "cuda" else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=pdtype, attn_implementation="sdpa")
    n_params = sum(p.numel() for p in model.parameters())
    rope_check = rope_vs_ours(model, cfg)
    build_s = time.time() - t0
    log(f"model: {type(model).__name__}, {n_params / 1e9:.3f} B params in {a.param_dtype}, built in {build_s:.1f} s; "
        f"rope {cfg.rope_parameters}; vs model.py: {rope_check}")

    # the data: dp * steps sequences of exactly seq_len tokens (every cp rank of a group reads the same one)
    datasets.disable_progress_bars()  # TRL's map/filter passes over a few rows: no bars
    rng = np.random.default_rng(a.seed)
    rows = [rng.integers(0, cfg.vocab_size, size=a.seq_len, dtype=np.int64).tolist() for _ in range(dp * a.steps)]
    train = Dataset.from_dict({"input_ids": rows})
    del rows

    distributed = world > 1 and device == "cuda"
    sft = dict(
        output_dir=tempfile.mkdtemp(prefix="reference_trl_"), max_steps=a.steps, per_device_train_batch_size=1,
        gradient_accumulation_steps=1, max_length=a.seq_len, packing=False, pad_to_multiple_of=2 * cp,
        # offload pins host memory, which needs a GPU (torch refuses pin_memory on a CPU-only machine)
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"offload": device == "cuda"},
        bf16=a.param_dtype == "float32" or a.lora_rank > 0, logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to="none", disable_tqdm=True, seed=a.seed, data_seed=a.seed, dataloader_num_workers=0,
        use_cpu=device == "cpu")
    if distributed:
        sft.update(
            fsdp=True,
            fsdp_config={"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                         "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"], "reshard_after_forward": True,
                         "cpu_ram_efficient_loading": False,  # the weights are drawn on each rank, not read
                         "state_dict_type": "FULL_STATE_DICT", "activation_checkpointing": False},
            parallelism_config=ParallelismConfig(dp_shard_size=dp, cp_size=cp))
    args = SFTConfig(**sft)

    steps = []  # one dict per step
    flops = step_flops(a, cfg, a.seq_len) * dp

    def write(complete: bool):
        if rank != 0:
            return
        timed = [s["step_time_s"] for s in steps[1:]] or [s["step_time_s"] for s in steps]
        t = statistics.median(timed) if timed else None
        peaks = [s["peak_mem_gib"] for s in steps if s.get("peak_mem_gib") is not None]
        host = [s["host_pinned_peak_gib"] for s in steps if s.get("host_pinned_peak_gib") is not None]
        rec = dict(
            what="TRL long-context recipe (SFTTrainer, FSDP2, accelerate CP, GC offload, YaRN, bf16, default loss)"
            + (f", PEFT LoRA r {a.lora_rank} all-linear" if a.lora_rank else ""), lora_rank=a.lora_rank,
            complete=complete, model=a.model, seq_len=a.seq_len, cp=cp, dp=dp, world=world, steps=a.steps,
            device=device, param_dtype=a.param_dtype, bf16_mixed_precision=args.bf16, fsdp2=distributed,
            gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs, loss_type=args.loss_type,
            rope_parameters=cfg.rope_parameters, max_position_embeddings=cfg.max_position_embeddings,
            rope_vs_model_py=rope_check, sdpa_backend=a.sdpa_backend, params=n_params, seed=a.seed,
            versions=versions, gpu=torch.cuda.get_device_name() if device == "cuda" else None,
            pytorch_cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            model_build_s=build_s, time_to_first_step_s=steps[0]["time_since_start_s"] if steps else None,
            s_per_step=t, tokens_per_s=a.seq_len * dp / t if t else None,
            mfu=flops / t / (world * PEAK_TFLOPS * 1e12) if t and device == "cuda" else None,
            peak_mem_gib=max(peaks) if peaks else None, host_pinned_peak_gib=max(host) if host else None,
            loss=[s.get("loss") for s in steps], step_records=steps,
            source=(f"torchrun --nproc_per_node {world} " if "RANK" in os.environ else "python ")
            + "bench/reference_trl.py " + " ".join(sys.argv[1:]))
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        tmp = a.out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(rec, fh, indent=2)
        os.replace(tmp, a.out)

    class Timing(transformers.TrainerCallback):
        """Step wall time between device syncs, peak memory per step (max over ranks), the logged loss."""

        def on_step_begin(self, args_, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                if hasattr(torch.cuda, "reset_peak_host_memory_stats"):
                    torch.cuda.reset_peak_host_memory_stats()
            self.t = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - self.t
            rec = dict(step=state.global_step, step_time_s=dt, time_since_start_s=time.time() - T_START)
            if device == "cuda":
                try:  # pinned host memory in use (GC offload's saved layer inputs), where this torch reports it
                    host = torch.cuda.host_memory_stats()["active_bytes.peak"]
                except (AttributeError, KeyError, RuntimeError):
                    host = -1.0
                m = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), host],
                                 dtype=torch.float64, device="cuda")
                if dist.is_initialized():
                    dist.all_reduce(m, op=dist.ReduceOp.MAX)
                rec.update(peak_mem_gib=m[0].item() / 2**30, peak_reserved_gib=m[1].item() / 2**30,
                           host_pinned_peak_gib=m[2].item() / 2**30 if m[2].item() >= 0 else None)
            else:
                rec.update(peak_mem_gib=None, peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
            steps.append(rec)

        def on_log(self, args_, state, control, logs=None, **kw):
            if not steps or not logs or "loss" not in logs:
                return
            s = steps[-1]
            s.update(loss=logs["loss"], grad_norm=logs.get("grad_norm"))
            mem = f" | peak mem {s['peak_mem_gib']:.1f} GiB" if s.get("peak_mem_gib") is not None else ""
            host = f" | pinned host {s['host_pinned_peak_gib']:.1f} GiB" if s.get("host_pinned_peak_gib") else ""
            gn = f" | grad norm {s['grad_norm']:.3f}" if s.get("grad_norm") is not None else ""
            log(f"step {s['step']:4d} | loss {s['loss']:.4f}{gn} | {a.seq_len * dp / s['step_time_s']:,.0f} tok/s | "
                f"{s['step_time_s']:.2f} s{mem}{host} | {s['time_since_start_s']:.1f} s since start")
            write(complete=False)

    peft_config = None
    if a.lora_rank:
        from peft import LoraConfig
        peft_config = LoraConfig(r=a.lora_rank, lora_alpha=a.lora_alpha or 2 * a.lora_rank, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    t0 = time.time()
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tiny_tokenizer(cfg, transformers),
                         callbacks=[Timing()], peft_config=peft_config)
    if a.lora_rank:
        trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        log(f"PEFT LoRA r {a.lora_rank}, alpha {peft_config.lora_alpha}, all-linear: {trained / 1e6:.2f} M trained")
    trainer.remove_callback(transformers.PrinterCallback)  # its dict per step; Timing prints one line instead
    log(f"trainer ready in {time.time() - t0:.1f} s: world {world}, cp {cp}, dp {dp}, "
        f"{'FSDP2 + CP' if distributed and cp > 1 else 'FSDP2' if distributed else 'no FSDP'}, "
        f"bf16 mixed precision {args.bf16}, GC {args.gradient_checkpointing_kwargs}, loss_type {args.loss_type!r}, "
        f"{time.time() - T_START:.1f} s since start")

    sdpa = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
    if a.sdpa_backend != "auto":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        ctx = sdpa_kernel(getattr(SDPBackend, sdpa[a.sdpa_backend]))
    else:
        import contextlib
        ctx = contextlib.nullcontext()
    with ctx:  # the backward (and its recompute) runs inside train() too
        trainer.train()
    write(complete=True)
    if rank == 0 and steps:
        timed = [s["step_time_s"] for s in steps[1:]] or [steps[0]["step_time_s"]]
        t = statistics.median(timed)
        peak = max((s["peak_mem_gib"] for s in steps if s.get("peak_mem_gib") is not None), default=None)
        log(f"time to first step: {steps[0]['time_since_start_s']:.1f} s; median step (after the first): {t:.2f} s; "
            + (f"peak mem {peak:.2f} GiB; " if peak is not None else "") + f"-> {a.out}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
