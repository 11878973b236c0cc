"""What each step reports: its printed line and its out_dir/metrics.jsonl row (loss, gradient norm, speed, MFU,
memory, the time left, and what a window of packed documents held).

    torchrun --standalone --nproc_per_node 2 train.py --config demo --data examples/chat.jsonl
"""
import math
import statistics
import time

import torch
import torch.distributed as dist

from million.evaluate import peak_memory


def driver_view_gib(device) -> tuple[float, float]:
    """(outside, reserved), each the largest over ranks, in GiB. outside: what the driver counts as used on the GPU
    beyond what PyTorch's allocator reserves now (the CUDA context, the libraries' handles, NCCL's buffers, kernels'
    local memory; other processes' too), what the margin plan.py leaves must cover. reserved: the most the
    allocator held during the step (train.py resets the peaks at each step's start), its cache included; the card
    must hold it, while plan.py predicts the peak of what is allocated (1.6 to 2.8 GiB apart with the expandable
    segments train.py asks for, 6 to 16 without: bench/RESULTS.md, "The allocator's cache")."""
    free, total = torch.cuda.mem_get_info()
    x = torch.tensor([total - free - torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved()],
                     dtype=torch.float64, device=device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x[0].item() / 2**30, x[1].item() / 2**30


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


def attention_area(batch) -> float:
    """The share of the full causal triangle that a step's attention computes: 1 for one sequence, the sum of
    len^2 over len^2 of the window for packed documents (this rank's windows)."""
    lens = [getattr(m, "doc_lens", None) for m in batch]
    return sum(1.0 if d is None else sum(n * n for n in d) / sum(d) ** 2 for d in lens) / len(batch)


def packed_stats(batch, n_trained: int, n_pad: int, n_pairs: int, cp: int, balanced: bool) -> dict:
    """What a step's windows of packed documents held, for its metrics row: documents a window, the shares of
    padding and of untrained tokens, and the busiest rank's attention over a full causal window's (what plan.py
    times)."""
    from million import documents
    return dict(docs=sum(len(m.doc_lens) - (m.pad > 0) for m in batch) / len(batch),  # padding is no document
                pad_share=n_pad / n_pairs, untrained_share=1 - (n_trained + n_pad) / n_pairs,
                attn_area=sum(documents.document_area(m.doc_lens, cp, balanced) for m in batch) / len(batch))


def describe(mcfg, shapes: dict) -> str:
    """'36 layers, hidden 4096, 8.19 B parameters, rope_scaling {...}', with a MoE's active share."""
    n = sum(math.prod(x) for x in shapes.values())
    count = lambda n: f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.1f} K"  # noqa
    experts = ""
    if getattr(mcfg, "num_experts", 0):
        from million import plan
        experts = (f" ({count(plan.Shape.of(mcfg, 1, 1, 1, 1).active_params)} active: top-{mcfg.num_experts_per_tok}"
                   f" of {mcfg.num_experts} experts" + (", load-balancing loss" if mcfg.output_router_logits else "")
                   + ")")
    return (f"{mcfg.num_hidden_layers} layers, hidden {mcfg.hidden_size}, {count(n)} parameters{experts}, "
            f"rope_scaling {mcfg.rope_scaling}")


class Meter:
    """Each step's printed line and metrics.jsonl row: 'step N/max [elapsed<remaining, rate] | loss ...'."""

    def __init__(self, cfg, run, world: int):
        self.cfg, self.run, self.world, self.eval_log, self.times = cfg, run, world, None, []
        self.t0 = time.time()
        self.n_pairs = cfg.seq_len * cfg.grad_accum * (world // run.setup.mesh.size(1))  # (input, label) pairs a step
        self.flops = (0.0, 0.0)  # useful FLOPs a step over all ranks: (matmuls, causal attention), for MFU on CUDA
        if cfg.device == "cuda":
            from million import fit
            self.flops = fit.step_flops(cfg, run.setup.mcfg, world)

    def log_step(self, step, result, dt, batch, n_trained, n_pad, log):
        cfg, setup = self.cfg, self.run.setup
        loss, grad_norm, applied, by_position, aux_loss = result
        self.times.append(dt)
        offload = setup.model.layers[0].offload
        lr = self.run.opt.param_groups[0]["lr"]
        flops = self.flops[0] + self.flops[1] * attention_area(batch)
        rec = dict(step=step, loss=loss, grad_norm=grad_norm, num_tokens=n_trained, lr=lr, step_time_s=dt,
                   tokens_per_s=self.n_pairs / dt,
                   mfu=flops / dt / (self.world * cfg.peak_tflops * 1e12) if cfg.device == "cuda" else None,
                   peak_mem_gib=peak_memory(cfg, setup.device) / 2**30,
                   host_pinned_gib=(offload.host_bytes() if offload is not None else 0) / 2**30,
                   loss_by_position=by_position,  # [--loss_buckets] means over equal spans of position
                   skipped_rows=self.run.batches.skipped)  # rows of the data left out so far, text or not
        if cfg.device == "cuda":
            rec["outside_gib"], rec["reserved_gib"] = driver_view_gib(setup.device)
        if aux_loss is not None:
            rec["aux_loss"] = aux_loss
        if getattr(batch[0], "doc_lens", None) is not None:  # packed documents: what the windows held
            rec.update(packed_stats(batch, n_trained, n_pad, self.n_pairs, setup.mesh.size(1),
                                    cfg.doc_attention == "balanced"))
        if not applied:
            rec["skipped"] = True
        why = "nothing to train on in these windows" if not n_trained else "non-finite loss or grad norm"
        eta = progress(time.time() - self.t0, self.times, cfg.max_steps - step)
        log(f"step {step:4d}/{cfg.max_steps} [{eta}] | loss {loss:.4f} | "
            + (f"aux loss {aux_loss:.4f} | " if aux_loss is not None else "")
            + f"grad norm {grad_norm:.3f} | lr {lr:.2e} | {rec['tokens_per_s']:,.0f} tok/s | "
            + (f"MFU {rec['mfu']:.1%} | " if rec["mfu"] is not None else "")
            + f"{dt:.2f} s | peak mem {rec['peak_mem_gib']:.1f} GiB"
            + (f" | {rec['docs']:.0f} docs, {rec['pad_share']:.1%} padding, {rec['untrained_share']:.1%} untrained"
               if "docs" in rec else "")
            + ("" if applied else f" | SKIPPED: {why}, no weight changed"))
        if self.run.metrics:
            self.run.metrics.write(rec)
