"""HF-format checkpoints, an extension of model.py: safetensors load and save in the layout transformers reads
(Qwen3ForCausalLM, or Qwen3MoeForCausalLM with one tensor per expert as on the hub), a hub id fetched to a local
folder, and load_or_init_state_dict, the one place where weights are read or drawn. train.py reads with
load_or_init_state_dict on rank 0 (then broadcasts) and writes with save_hf; from_pretrained and save_pretrained do
the same in one process.

    python -c "import hf, torch; print(hf.from_pretrained('Qwen/Qwen3-0.6B', torch.float32).cfg)"
    python -m pytest tests/test_model.py tests/test_moe.py -q -k "load or save or hub or checkpoint"
"""
import json
import os
import warnings

import torch

from model import Qwen3, Qwen3Config, causal_attention
from moe import Qwen3MoE, hf_expert_names

HF_SHARD_BYTES = 5 * 2**30  # safetensors shard size of save_pretrained (transformers' default, 5 GiB)


def hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


def hf_names(name: str, num_experts: int) -> list[str]:
    """Our parameter name -> its tensors' names in an HF checkpoint: one, or for stacked expert weights the hub's
    one per expert (moe.hf_expert_names)."""
    return hf_expert_names(name, num_experts) or [hf_name(name)]


def model_class(cfg: Qwen3Config) -> type:
    """The model a config builds: moe.Qwen3MoE when it has experts, else model.Qwen3."""
    return Qwen3MoE if cfg.num_experts else Qwen3


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
    from safetensors import safe_open
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        return None
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    tensors = {}
    for f in files:
        with safe_open(os.path.join(path, f), framework="pt") as st:
            for k in st.keys():
                tensors[k] = st.get_tensor(k)
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
    sd = load_hf_state_dict(path, names, dtype, mcfg.num_experts) if path else None
    if sd is not None:
        return sd
    if path:
        warnings.warn(f"{path} has a config.json but no *.safetensors: random initialisation")
    with torch.device(device):
        ref = model_class(mcfg)(mcfg).to(dtype)
    ref.init_weights(torch.Generator(device).manual_seed(seed))
    return ref.state_dict()


def save_hf(out_dir: str, cfg: Qwen3Config, state_dict: dict, max_shard_bytes: int = HF_SHARD_BYTES):
    """config.json + safetensors shards (+ index when sharded) that transformers loads as Qwen3ForCausalLM (or
    Qwen3MoeForCausalLM, the experts one tensor each, as on the hub)."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for n, t in state_dict.items():
        t, hs = t.detach().cpu(), hf_names(n, cfg.num_experts)
        # an expert's slice is cloned: safetensors refuses tensors that share memory
        tensors.update({hs[0]: t.contiguous()} if len(hs) == 1 else {h: t[e].clone() for e, h in enumerate(hs)})
    shards, size = [{}], 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k], size = t, size + nbytes
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    umask = os.umask(0o022)
    os.umask(umask)
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
        os.chmod(os.path.join(out_dir, name), 0o666 & ~umask)  # safetensors writes 0600: others could not read it
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
            json.dump(index, fh, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump({**cfg.to_dict(), "torch_dtype": dtype, "dtype": dtype}, fh, indent=2)


def from_pretrained(path_or_hub_id: str, dtype=torch.bfloat16, device="cpu", attn_fn=causal_attention,
                    seed: int = 0) -> Qwen3:
    """An HF Qwen3 (or Qwen3-MoE) folder or hub id -> the model in dtype on device; a folder with only a
    config.json gives weights drawn from `seed` (load_or_init_state_dict)."""
    path = local_folder(path_or_hub_id)
    cfg = Qwen3Config.from_pretrained(path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, attn_fn)
    sd = load_or_init_state_dict(path, cfg, list(model.state_dict()), dtype, seed, device)
    model.load_state_dict({n: t.to(device) for n, t in sd.items()}, assign=True)
    return model


def save_pretrained(model: Qwen3, out_dir: str, state_dict=None, max_shard_bytes: int = HF_SHARD_BYTES):
    """save_hf of the model's own config and weights (or of `state_dict`, a full one gathered elsewhere)."""
    save_hf(out_dir, model.cfg, state_dict if state_dict is not None else model.state_dict(), max_shard_bytes)
