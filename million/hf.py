"""HF-format checkpoints, an extension of model.py: safetensors load and save in the layout transformers reads
(Qwen3ForCausalLM, or Qwen3MoeForCausalLM with one tensor per expert as on the hub), a hub id fetched to a local
folder, and load_or_init_state_dict, the one place where weights are read or drawn. train.py reads with
load_or_init_state_dict on rank 0 (then broadcasts) and writes with save_hf; from_pretrained and save_pretrained do
the same in one process. A Qwen3.5 config.json (model_type qwen3_5 or qwen3_5_text) is read, and its weights
read, drawn and saved, by qwen3_5.py, imported where that model type is met. The files themselves (safetensors
shards, RoPE fields), which both read and write, are hf_files.py's.

    python -c "from million import hf; print(hf.from_pretrained('Qwen/Qwen3-0.6B', torch.float32).cfg)"
    python -m pytest tests/test_model.py tests/test_moe.py -q -k "load or save or hub or checkpoint"
"""
import json
import os
import warnings

import torch

from model import Qwen3, Qwen3Config, causal_attention
from million.hf_files import HF_SHARD_BYTES, parse_rope, read_safetensors, write_safetensors
from million.moe import Qwen3MoE, Qwen3MoeConfig, hf_expert_names


# --- config.json <-> Qwen3Config --------------------------------------------------------------

def refuse_unsupported(d: dict):
    """Stop on an HF config this trainer cannot train exactly: ring attention needs full causal attention
    in every layer."""
    where = d.get("_name_or_path", "config.json")
    if d.get("model_type") not in ("qwen3", "qwen3_moe"):
        raise ValueError(f"{where}: model_type {d.get('model_type')!r} is not supported; supported: 'qwen3' "
                         "(Qwen3), 'qwen3_moe' (Qwen3-MoE), 'qwen3_5' and 'qwen3_5_text' (Qwen3.5), 'qwen3_5_moe' and "
                         "'qwen3_5_moe_text' (Qwen3.5-MoE).")
    experts = d.get("num_experts", d.get("num_local_experts"))
    if d["model_type"] == "qwen3" and experts:
        raise ValueError(f"{where}: num_experts in a 'qwen3' config, which transformers builds dense; a "
                         "mixture-of-experts model says model_type 'qwen3_moe'.")
    if d["model_type"] == "qwen3_moe" and experts is not None and not (
            0 < d.get("num_experts_per_tok", 8) <= experts and d.get("decoder_sparse_step", 1) >= 1):
        raise ValueError(f"{where}: a 'qwen3_moe' config needs num_experts >= num_experts_per_tok >= 1 and "
                         "decoder_sparse_step >= 1 (with no experts, use a dense 'qwen3' config).")
    if d.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window is true; ring attention needs full attention in every layer")
    bad_layers = sorted({t for t in d.get("layer_types") or [] if t != "full_attention"})
    if bad_layers:
        raise ValueError(f"{where}: layer_types has {bad_layers}; only 'full_attention' layers are supported.")
    if d.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias is true, which Qwen3 never uses; not supported.")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {d['hidden_act']!r} is not supported (Qwen3 uses 'silu').")


SAVED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings")
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
              "output_router_logits", "router_aux_loss_coef")


def config_from_dict(d: dict) -> Qwen3Config:
    """An HF Qwen3 or Qwen3-MoE config.json dict (either RoPE style) -> Qwen3Config, or moe.Qwen3MoeConfig."""
    refuse_unsupported(d)
    theta, scaling = parse_rope(d)
    heads = d["num_attention_heads"]
    moe = {}
    if d["model_type"] == "qwen3_moe":  # transformers saves num_experts as num_local_experts; both are read
        moe = dict(num_experts=d.get("num_experts", d.get("num_local_experts", 128)),
                   **{k: d[k] for k in MOE_FIELDS[1:] if d.get(k) is not None},
                   mlp_only_layers=list(d.get("mlp_only_layers") or []))
    config = Qwen3MoeConfig if moe else Qwen3Config
    return config(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                  intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
                  num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads", heads),
                  head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                  rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
                  tie_word_embeddings=d.get("tie_word_embeddings", False),
                  max_position_embeddings=d.get("max_position_embeddings", 40960),
                  initializer_range=d.get("initializer_range", 0.02), **moe, raw=dict(d))


def read_json(path: str) -> dict:
    """A local folder's config.json as a dict; errors say what to pass instead."""
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise FileNotFoundError(f"no config.json in {path!r}: pass a folder holding an HF Qwen3 checkpoint "
                                "(or only its config.json, to train from random initialisation).")
    try:
        with open(f) as fh:
            return json.load(fh)
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON ({e})") from None


def model_type(path: str) -> str:
    """config.json's model_type in a local folder ("" when there is none to read: read_config then says why)."""
    try:
        return str(read_json(path).get("model_type", ""))
    except (OSError, ValueError):
        return ""


def read_config(path: str) -> Qwen3Config:
    """The config of a local folder's config.json: a Qwen3Config (moe.Qwen3MoeConfig for Qwen3-MoE,
    qwen3_5.Qwen3_5Config for Qwen3.5); errors say what to pass instead."""
    d = read_json(path)
    if str(d.get("model_type", "")).startswith("qwen3_5"):  # Qwen3.5: DeltaNet and gated attention layers
        from million import qwen3_5
        return qwen3_5.read_config(path)
    return config_from_dict(d)


def config_to_dict(cfg: Qwen3Config) -> dict:
    """config.json for a save: the fields read (cfg.raw), with the shape and the RoPE this run trained with."""
    d = dict(cfg.raw)
    d.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], **{k: getattr(cfg, k) for k in SAVED_FIELDS},
             hidden_act="silu", attention_bias=False)
    rope = {"rope_type": "yarn", **cfg.rope_scaling} if cfg.rope_scaling else {"rope_type": "default"}
    if "rope_parameters" in d:  # keep the style the checkpoint came in
        d["rope_parameters"] = {**rope, "rope_theta": cfg.rope_theta}
    else:
        d["rope_theta"], d["rope_scaling"] = cfg.rope_theta, (rope if cfg.rope_scaling else None)
    if isinstance(cfg, Qwen3MoeConfig):
        d.pop("num_local_experts", None)  # one name for it: the hub's
        d.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                 **{k: getattr(cfg, k) for k in MOE_FIELDS}, mlp_only_layers=list(cfg.mlp_only_layers))
    return d


def hf_name(name: str, cfg=None) -> str:
    """Our parameter name -> its name in an HF checkpoint; cfg matters for Qwen3.5 (a vision-language checkpoint
    nests the text decoder)."""
    if getattr(cfg, "model_type", "") == "qwen3_5":
        from million import qwen3_5
        return qwen3_5.hf_name(name, cfg)
    return name if name.startswith("lm_head.") else "model." + name


def hf_names(name: str, num_experts: int) -> list[str]:
    """Our parameter name -> its tensors' names in an HF checkpoint: one, or for stacked expert weights the hub's
    one per expert (moe.hf_expert_names)."""
    return hf_expert_names(name, num_experts) or [hf_name(name)]


def model_class(cfg: Qwen3Config) -> type:
    """The model a config builds: moe.Qwen3MoE for a Qwen3MoeConfig, qwen3_5.Qwen3_5 (or Qwen3_5Moe) for a
    Qwen3_5Config, else model.Qwen3."""
    if getattr(cfg, "model_type", "") == "qwen3_5":
        from million import qwen3_5
        return qwen3_5.model_class(cfg)
    return Qwen3MoE if isinstance(cfg, Qwen3MoeConfig) else Qwen3


def local_folder(path_or_hub_id: str) -> str:
    """A local folder as is; otherwise a hub id fetched with snapshot_download (config, weights, tokenizer)."""
    if os.path.isdir(path_or_hub_id):
        return path_or_hub_id
    looks_local = path_or_hub_id.startswith((".", "/", "~")) or path_or_hub_id.count("/") != 1
    if looks_local:
        raise FileNotFoundError(f"{path_or_hub_id!r}: no such folder, and not a hub id of the form 'org/name'. "
                                "Pass a folder with config.json (+ *.safetensors) or a hub id such as Qwen/Qwen3-8B.")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(path_or_hub_id, allow_patterns=["config.json", "*.safetensors", "*.json",
                                                                 "tokenizer*", "*.txt"])
    except Exception as e:  # network, auth, missing repo: all end the same way for the user
        raise ConnectionError(f"could not download {path_or_hub_id!r} from the Hugging Face hub ({type(e).__name__}: "
                              f"{e}). Check the network and HF_TOKEN, or download it elsewhere and pass the local "
                              "folder instead.") from e


def load_hf_state_dict(path: str, names: list[str], dtype, num_experts: int = 0) -> dict | None:
    """Our parameter names -> tensors from (possibly sharded) safetensors, the experts' stacked; None when the
    folder has none."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        return None
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    tensors = {}
    for f in files:
        tensors.update(read_safetensors(os.path.join(path, f)))
    want = {n: hf_names(n, num_experts) for n in names}
    missing = sorted(h for hs in want.values() for h in hs if h not in tensors)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    extra = sorted(set(tensors) - {h for hs in want.values() for h in hs} - {"lm_head.weight"})  # tied models may
    if extra:                                                                                 # still carry a head
        raise ValueError(f"{path}: checkpoint has weights this Qwen3 does not, e.g. {extra[:3]}")
    # each tensor read is dropped once used: the stacked experts do not hold a second copy of the checkpoint
    return {n: (torch.stack([tensors.pop(h) for h in hs]) if len(hs) > 1 else tensors.pop(hs[0])).to(dtype)
            for n, hs in want.items()}


def load_or_init_state_dict(path: str | None, mcfg: Qwen3Config, names: list[str], dtype, seed: int,
                            device) -> dict:
    """The full state dict {name: tensor in dtype}: read from path's *.safetensors (on the CPU), or drawn on
    `device` by init_weights from `seed` where there are none (path None, or a folder with only a config.json,
    with a warning). The draw is the same for any world size: runs at different cp agree on it."""
    if getattr(mcfg, "model_type", "") == "qwen3_5":  # its text decoder's weights, under their names
        from million import qwen3_5
        weights = path and any(f.endswith(".safetensors") for f in os.listdir(path))
        sd = qwen3_5.load_state_dict_from_hf(path, mcfg, names, dtype) if weights else None
    else:
        sd = load_hf_state_dict(path, names, dtype, getattr(mcfg, "num_experts", 0)) if path else None
    if sd is not None:
        return sd
    if path:
        warnings.warn(f"{path} has a config.json but no *.safetensors: random initialisation")
    with torch.device("meta"):  # allocated once, in dtype (not built in fp32 and cast: twice the bytes)
        ref = model_class(mcfg)(mcfg).to(dtype)
    device = torch.device(device)
    size = sum(p.numel() * p.element_size() for p in ref.parameters())
    if device.type == "cuda" and size > 0.4 * torch.cuda.get_device_properties(device).total_memory:
        # beside the model already placed there, a second copy would not fit (Qwen3.5-35B-A3B in bf16 on one H200)
        return draw_to_host(ref, seed, device)
    ref = ref.to_empty(device=device)
    ref.init_weights(torch.Generator(device).manual_seed(seed))
    return ref.state_dict()


def draw_to_host(ref: torch.nn.Module, seed: int, device) -> dict:
    """The weights of ref (a model on meta) as init_weights draws them on `device` from `seed`, the same numbers,
    drawn a tensor at a time and each moved to host memory at once: the device never holds more than one. (The CPU's
    generator, a single thread at a few hundred million numbers a second, would take minutes over 35 B.)"""
    generator, drawn = torch.Generator(device).manual_seed(seed), {}
    for name, p in ref.named_parameters():  # init_weights' order
        t = torch.empty(p.shape, dtype=p.dtype, device=device)
        ref.init_parameter(name, t, generator)
        drawn[name] = t.cpu()
    return drawn


def save_hf(out_dir: str, cfg: Qwen3Config, state_dict: dict, max_shard_bytes: int = HF_SHARD_BYTES):
    """config.json + safetensors shards (+ index when sharded) that transformers loads as Qwen3ForCausalLM (or
    Qwen3MoeForCausalLM, the experts one tensor each, as on the hub; Qwen3.5: qwen3_5.save_hf)."""
    if getattr(cfg, "model_type", "") == "qwen3_5":
        from million import qwen3_5
        return qwen3_5.save_hf(out_dir, cfg, state_dict, max_shard_bytes)
    tensors = {}
    for n, t in state_dict.items():
        t, hs = t.detach().cpu(), hf_names(n, getattr(cfg, "num_experts", 0))
        # an expert's slice is cloned: safetensors refuses tensors that share memory
        tensors.update({hs[0]: t.contiguous()} if len(hs) == 1 else {h: t[e].clone() for e, h in enumerate(hs)})
    write_safetensors(out_dir, tensors, max_shard_bytes)
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump({**config_to_dict(cfg), "torch_dtype": dtype, "dtype": dtype}, fh, indent=2)


def from_pretrained(path_or_hub_id: str, dtype=torch.bfloat16, device="cpu", attn_fn=causal_attention,
                    seed: int = 0) -> Qwen3:
    """An HF Qwen3 (or Qwen3-MoE) folder or hub id -> the model in dtype on device; a folder with only a
    config.json gives weights drawn from `seed` (load_or_init_state_dict)."""
    path = local_folder(path_or_hub_id)
    cfg = read_config(path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, attn_fn)
    sd = load_or_init_state_dict(path, cfg, list(model.state_dict()), dtype, seed, device)
    model.load_state_dict({n: t.to(device) for n, t in sd.items()}, assign=True)
    return model


def save_pretrained(model: Qwen3, out_dir: str, state_dict=None, max_shard_bytes: int = HF_SHARD_BYTES):
    """save_hf of the model's own config and weights (or of `state_dict`, a full one gathered elsewhere)."""
    save_hf(out_dir, model.cfg, state_dict if state_dict is not None else model.state_dict(), max_shard_bytes)
