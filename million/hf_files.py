"""The files of an HF checkpoint folder, whatever the model: safetensors shards read and written as transformers
reads and writes them, and the RoPE fields of a config.json. hf.py (Qwen3, Qwen3-MoE) and qwen3_5.py (Qwen3.5)
both build on it.
"""
import json
import os

HF_SHARD_BYTES = 5 * 2**30  # safetensors shard size of save_pretrained (transformers' default, 5 GiB)


def parse_rope(d: dict) -> tuple[float, dict | None]:
    """-> (theta, YaRN scaling or None). Older configs say rope_theta + rope_scaling, newer ones
    rope_parameters (with theta inside)."""
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or d.get("rope_theta", 1e6)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"{d.get('_name_or_path', 'config.json')}: rope type {rope_type!r} is not supported; "
                         "use 'default' or 'yarn'.")
    if rope_type == "default":
        return float(theta), None
    scaling = {k: rope[k] for k in ("factor", "original_max_position_embeddings", "attention_factor",
                                    "beta_fast", "beta_slow") if rope.get(k) is not None}
    scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    return float(theta), scaling


def read_safetensors(file: str) -> dict:
    """{name: tensor} of one safetensors file; a file cut short or not safetensors is named, with what to do."""
    from safetensors.torch import load_file
    try:
        return load_file(file)
    except Exception as e:  # safetensors' SafetensorError, or an OSError
        raise ValueError(f"{file} cannot be read as safetensors ({type(e).__name__}: {e}): a download or copy cut "
                         "short? Fetch the checkpoint again (a hub id: delete that file from the hub cache first)"
                         ) from None


def write_safetensors(out_dir: str, tensors: dict, max_shard_bytes: int = HF_SHARD_BYTES):
    """{HF name: tensor} as safetensors shards of at most max_shard_bytes (model.safetensors, or
    model-0000i-of-0000n.safetensors and their index), readable by others as transformers' own files are."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    shards, size = [{}], 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k], size = t, size + nbytes
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
