"""train.py's pieces in-process: the optimizer's states made up front, AdamW's betas from the flags, the
progress line, and the lines that refuse bad flag values. train.py itself, run end to end under torchrun, is
tested in tests/e2e/test_train.py."""
import torch


def test_optimizer_states_made_up_front_change_nothing():
    """init_optimizer_state (AdamW's states allocated before the first step) leaves every later step bit-equal."""
    from train import init_optimizer_state
    torch.manual_seed(0)
    ref = torch.nn.Linear(7, 5)
    pre = torch.nn.Linear(7, 5)
    pre.load_state_dict(ref.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1) for m in (ref, pre)]
    init_optimizer_state(opts[1])
    assert len(opts[1].state) == 2 and torch.equal(pre.weight, ref.weight)
    for _ in range(3):
        x = torch.randn(4, 7)
        for m, opt in zip((ref, pre), opts):
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert torch.equal(pre.weight, ref.weight) and torch.equal(pre.bias, ref.bias)


def test_adamw_betas_come_from_the_flags():
    from million import config
    from train import make_optimizer
    cfg = config.TrainConfig(device="cpu", beta1=0.5, beta2=0.6)
    opt = make_optimizer(cfg, torch.nn.Linear(3, 2))
    assert opt.param_groups[0]["betas"] == (0.5, 0.6)


def test_progress_reads_as_trl_writes_it():
    from million.metrics import clock, progress
    assert progress(380.1, [380.1], 11) == "06:20<1:09:41, 380.10s/it"  # TRL: 1/12 [06:20<1:09:41, 380.10s/it]
    assert progress(1.0, [0.2, 0.25, 9.0], 100) == "00:01<00:25, 4.00it/s"  # the median, not the mean
    assert clock(0) == "00:00" and clock(59.6) == "01:00" and clock(3600) == "1:00:00" and clock(90061) == "25:01:01"


def test_the_allocator_grows_by_pages_unless_told_otherwise():
    """train.py asks for expandable segments where torch reads the setting: once, as it is imported (set after
    `import torch`, it was ignored: a GPU run's memory snapshot showed fixed segments and 16 GiB of cache). A
    PYTORCH_CUDA_ALLOC_CONF of the user's own stays as given."""
    import os
    import subprocess
    import sys

    import pytest
    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        pytest.skip("this torch cannot say what its allocator read (torch 2.13 can)")
    code = "import train, torch; print(torch._C._accelerator_getAllocatorSettings())"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    for given, want in ((None, "expandable_segments:True"), ("max_split_size_mb:512", "max_split_size_mb:512")):
        run_env = env if given is None else {**env, "PYTORCH_CUDA_ALLOC_CONF": given}
        out = subprocess.run([sys.executable, "-c", code], cwd=root, env=run_env, capture_output=True, text=True,
                             check=True).stdout
        assert out.strip() == want, out


def test_the_driver_s_view_is_read_and_reduced_over_ranks(tmp_path, monkeypatch):
    """metrics.driver_view_gib, the metrics rows' outside_gib and reserved_gib on a GPU, with the CUDA counters
    replaced by fixed numbers (this runs on the CPU): outside is the driver's used memory less the allocator's
    reserve now, reserved the allocator's peak, both the largest over ranks (all_reduce MAX, a world of one here)."""
    import torch.distributed as dist
    from million import metrics
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (30 * gib, 80 * gib))  # (free, total): 50 used
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 47 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 61.5 * gib)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert metrics.driver_view_gib(torch.device("cpu")) == (3.0, 61.5)
    finally:
        dist.destroy_process_group()


def test_a_bad_flag_value_is_named_with_its_value_and_the_rule():
    """config.check_config: each bad value stops the run with one line naming the flag, the value given and what
    it must be (train.py prints it on rank 0); a value on the edge passes."""
    import pytest
    from million import config

    def error(*flags):
        cfg, _ = config.parse_args(["--config", "demo", *flags])
        try:
            config.check_config(cfg, 2)
        except SystemExit as e:
            return e.code
    assert error("--lr", "-1") == "error: --lr -1.0: must be > 0"
    assert error("--min_lr_ratio", "1.5") == "error: --min_lr_ratio 1.5: must lie in 0..1 (of --lr)"
    assert error("--grad_accum", "0") == "error: --grad_accum 0: must be >= 1"
    assert error("--warmup_steps", "-2") == "error: --warmup_steps -2: must be >= 0"
    assert error("--ckpt_every_min", "-1.0") == "error: --ckpt_every_min -1.0: must be >= 0"
    assert error("--seq_len", "1001") == ("error: --seq_len 1001 must be a positive multiple of 2*cp = 4 (zigzag "
                                          "sharding cuts the sequence into 2*cp equal chunks); e.g. --seq_len 1000")
    assert error("--min_lr_ratio", "1", "--warmup_steps", "0", "--ckpt_every", "0") is None
    with pytest.raises(SystemExit):  # a type argparse cannot read: its own usage line
        config.parse_args(["--config", "demo", "--lr", "fast"])
