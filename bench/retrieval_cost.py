"""What the retrieval test (retrieval.py) costs against the plain forward it is built on, on the GPU.

Times, for the model and length train.py's flags give (random init is fine: cost does not depend on the weights):
- one forward of --seq_len tokens as evaluate.py runs it (the chunked loss over every row), median of --repeat;
- one retrieval window (retrieval.score: the same forward, then only the answers' rows through the head), median
  of --repeat; a window at the training length holds every depth of the grid, so it scores many cells at once;
- the whole default grid once (--retrieval_* flags), beside the cost model's prediction (retrieval.forward_seconds).

    torchrun --standalone --nproc_per_node 1 bench/retrieval_cost.py --model bench/configs/qwen3-8b \\
        --tokenizer byte --data synthetic --seq_len 131072 --out /tmp/retrieval_cost.json
    python bench/retrieval_cost.py --config demo --out /tmp/retrieval_cost_cpu.json    # the wiring, on a CPU
"""
import gc
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from million import config  # noqa: E402
import data  # noqa: E402
from million import fit  # noqa: E402
import parallel  # noqa: E402
from million import plan  # noqa: E402
from million import retrieval  # noqa: E402
import train  # noqa: E402
from million.survival import Log  # noqa: E402
from timing import seconds  # noqa: E402


def main(argv):
    out, repeat = "/tmp/retrieval_cost.json", 3
    if "--out" in argv:
        i = argv.index("--out")
        out = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    cfg, given = config.parse_args(argv)
    config.check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    rank, world, _ = train.init_distributed(cfg)
    cp = config.context_parallel(cfg, world)
    log = Log(rank)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    s = train.build(cfg, given, cp, world, device, log)
    s.model.eval()
    cp_group = s.mesh.get_group("cp")
    r, n = dist.get_rank(cp_group), dist.get_world_size(cp_group)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, s.mcfg.vocab_size, (cfg.seq_len + 1,), generator=g)
    inputs, labels, pos = (parallel.cp_shard(x, 0, r, n).to(device)[None]
                           for x in (ids[:-1], ids[1:], torch.arange(cfg.seq_len)))

    def forward():
        with torch.no_grad():
            s.model(inputs, pos, labels, loss_chunk=cfg.loss_chunk).loss_sum.item()

    tok = data.load_tokenizer(data.tokenizer_spec(cfg.tokenizer, s.model_path))
    grid = retrieval.parse_grid(cfg.retrieval_lengths, cfg.retrieval_depths, cfg.retrieval_keys,
                                cfg.retrieval_needles, cfg.seq_len, cp)
    windows = retrieval.build_windows(tok, grid, cfg.retrieval_data or cfg.eval_data or cfg.data, cfg.eval_split,
                                      cfg.seed)
    score = lambda ws: retrieval.score(s.model, ws, cp_group, s.mesh.get_local_rank("dp"), s.mesh.size(0), device)
    shape = fit.plan_shape(cfg, s.mcfg, world)
    seconds(forward, device)  # warm-up: kernels compiled, allocator grown
    fwd = [seconds(forward, device) for _ in range(repeat)]
    one = [seconds(lambda: score(windows[:1]), device) for _ in range(repeat)]
    everything = seconds(lambda: score(windows), device)
    rec = dict(model=cfg.model, seq_len=cfg.seq_len, world=world, cp=cp, attn_backend=shape.attn_backend,
               forward_s=fwd, window_s=one, ratio=statistics.median(one) / statistics.median(fwd),
               windows=len(windows), needles_per_window=len(windows[0].needles), cells=len(grid.depths),
               keys=grid.keys, grid_s=everything, predicted_forward_s=plan.forward_seconds(shape),
               predicted_grid_s=retrieval.forward_seconds(shape, windows, s.mesh.size(0)),
               device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rec, f, indent=1)
        print(f"forward {statistics.median(fwd):.2f} s | one window ({rec['needles_per_window']} needles) "
              f"{statistics.median(one):.2f} s = {rec['ratio']:.3f} x a forward | grid of {len(windows)} windows "
              f"{everything:.1f} s (predicted {rec['predicted_grid_s']:.1f} s; a forward predicted "
              f"{rec['predicted_forward_s']:.2f} s)")
    # The FSDP2 model sits in reference cycles (its hooks), which only the cyclic collector frees; left to the
    # interpreter's exit, its last all-gathers' work objects can be destroyed after the interpreter has begun to
    # tear down, and the process aborts ("terminate called without an active exception", seen once in CI).
    # So the model goes now, while everything is alive, and the process groups after it.
    del s, score, forward
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
