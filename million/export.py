"""The export at the end of a run (--save_dir): an HF folder that transformers loads as Qwen3ForCausalLM (hf.py),
or with LoRA a PEFT adapter folder or the merged model (lora.py), with the tokenizer the run used. Written beside
the folder and renamed into place.

    python -m pytest tests/e2e/test_train.py tests/e2e/test_long_runs.py tests/e2e/test_lora.py -q -k "save or export"
"""
import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from million import checkpoint
import data
from million import hf
from million import lora
import parallel
from million.survival import SharedError, on_rank0


def all_finite(model) -> bool:
    """True on every rank if every rank's weight shards are finite."""
    bad = sum(int((~torch.isfinite(parallel.local_shard(p))).sum()) for p in model.parameters())
    t = torch.tensor([float(bad)], device=next(model.parameters()).device)
    dist.all_reduce(t)
    return t.item() == 0



def export_hf(cfg, setup, log):
    """The HF export (--save_dir): weights + config.json + the tokenizer the run used, written beside the
    folder and renamed into place, so --save_dir is never a mix of two saves."""
    if not all_finite(setup.model):
        raise SharedError("error: the weights hold non-finite values; not exporting them to --save_dir")
    adapters_only = bool(cfg.lora_rank) and not cfg.merge_lora
    sd = get_model_state_dict(setup.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                    ignore_frozen_params=adapters_only))

    def write():
        final = os.path.abspath(cfg.save_dir)
        tmp = f"{final}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            if cfg.lora_rank:  # a PEFT adapter folder, or the merged model
                lora.save(tmp, setup.model, sd, cfg.model, cfg.merge_lora, getattr(torch, cfg.param_dtype))
            else:
                hf.save_hf(tmp, setup.mcfg, sd)
            spec = data.tokenizer_spec(cfg.tokenizer, setup.model_path)
            if os.path.isfile(spec):
                shutil.copy(spec, os.path.join(tmp, "tokenizer.json"))
            for f in os.listdir(spec) if os.path.isdir(spec) else []:
                if f.startswith("tokenizer") or f in ("vocab.json", "merges.txt", "generation_config.json"):
                    shutil.copy(os.path.join(spec, f), tmp)
            checkpoint.publish(tmp, final)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise checkpoint.write_error(final, sum(t.numel() * t.element_size() for t in sd.values()), e,
                                         "free space there or choose another --save_dir") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log(f"exported HF weights to {cfg.save_dir}")
    on_rank0(write, setup.device)
