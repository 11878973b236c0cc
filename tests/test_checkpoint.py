"""Nothing lost, in-process: a log line or a whole file that does not fit on the disk is cut back or not written at
all, checksums find one changed byte and name its segment, and the size estimate covers a real checkpoint. The
faults injected into real train.py runs (torchrun, CPU, gloo) are in tests/e2e/test_checkpoint.py.

    python -m pytest tests/test_checkpoint.py -q
"""
import errno
import json
import os

import pytest
import torch
import torch.distributed as dist

from million import checkpoint
from million import rundir


def random_bytes(n: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()


# --- in-process: the writers, the checksums, the size of a checkpoint --------------------------------------

def failing_write(monkeypatch, keep: int | None):
    """os.write as on a full disk: it writes `keep` bytes of what it is given (a short write), or (None) fails."""
    real = os.write

    def write(fd, data):
        if keep is None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, bytes(data)[:keep])
    monkeypatch.setattr(os, "write", write)


def test_a_line_that_does_not_fit_is_cut_back(tmp_path, monkeypatch):
    log = rundir.JsonlLog(str(tmp_path / "metrics.jsonl"), 0)
    log.write({"step": 1, "loss": 1.5})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    for keep in (7, None):  # a short write, then a failed one
        failing_write(monkeypatch, keep)
        with pytest.raises(OSError) as e:
            log.write({"step": 2, "loss": 1.25})
        monkeypatch.undo()
        assert (tmp_path / "metrics.jsonl").read_bytes() == before
        msg = str(e.value)
        assert "\n" not in msg and f"writing {tmp_path}/metrics.jsonl failed (No space left on device)" in msg
        assert f"it needed {len(json.dumps({'step': 2, 'loss': 1.25})) + 1} bytes, its disk has" in msg
        assert msg.endswith("free; free space there or choose another --out_dir"), msg
    log.write({"step": 2, "loss": 1.25})
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [1, 2]


def test_a_whole_file_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    path = str(tmp_path / "latest")
    checkpoint.write_file(path, b"old")

    def no_room(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", no_room)
    with pytest.raises(OSError, match=r"writing .*/latest failed \(No space left on device\): it needed 4 bytes"):
        checkpoint.write_file(path, b"new!")
    assert open(path, "rb").read() == b"old" and os.listdir(tmp_path) == ["latest"]


def fake_checkpoint(folder, sizes: dict, segment: int, seed=0):
    """Files of random bytes and a manifest with their checksums per `segment` bytes, as save() writes it."""
    folder.mkdir()
    for i, (name, n) in enumerate(sizes.items()):
        (folder / name).write_bytes(random_bytes(n, seed + i))
    crc = {name: checkpoint.checksums(str(folder / name), segment) for name in sizes}
    (folder / "manifest.json").write_text(json.dumps({"step": 1, "files": sizes, "crc32": crc,
                                                      "segment_bytes": segment, "fingerprint": {}}))


def test_checksums_find_one_changed_byte_and_name_its_segment(tmp_path):
    ckpt = tmp_path / "step_0000001"
    fake_checkpoint(ckpt, {"__0_0.distcp": 10_000, "__1_0.distcp": 9_000, ".metadata": 333, "trainer.json": 50}, 4096)
    assert checkpoint.verify(str(ckpt)) is None
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert len(manifest["crc32"]["__0_0.distcp"]) == 3  # 4096 + 4096 + 1808 bytes
    data = bytearray((ckpt / "__1_0.distcp").read_bytes())
    data[5000] ^= 1
    (ckpt / "__1_0.distcp").write_bytes(bytes(data))
    assert checkpoint.verify(str(ckpt)) == ("__1_0.distcp differs from the bytes written (the CRC-32 of its bytes "
                                            "4,096 to 8,192)")
    # dealt by size: each rank checks its share; every file is some rank's, once
    shares = checkpoint._deal(manifest["files"], 2)
    assert sorted(sum(shares, [])) == sorted(manifest["files"]) and shares[0] == ["__0_0.distcp"]
    assert checkpoint.verify(str(ckpt), rank=0, world=2) is None
    assert "__1_0.distcp differs" in checkpoint.verify(str(ckpt), rank=1, world=2)
    assert checkpoint.verify(str(ckpt), checksum=False) is None  # sizes only: as rank 0 lists the candidates


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_size_estimate_covers_a_real_checkpoint(tmp_path, world_of_one):
    """state_bytes of the tiny model with AdamW states against what save() writes: above it, by under 5%."""
    from model import Qwen3, Qwen3Config
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = Qwen3(Qwen3Config.tiny()).float()
    model.init_weights(torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    checkpoint.save(str(tmp_path / "ckpt"), 1, state, {"step": 1, "config": {}}, {"model": {}}, keep=1)
    ckpt = tmp_path / "ckpt" / "step_0000001"
    real = sum(f.stat().st_size for f in ckpt.iterdir())
    assert real < checkpoint.state_bytes(state, 1) < 1.05 * real  # 1.68 MB against 1.64 MB
    assert checkpoint.verify(str(ckpt)) is None


def test_a_dense_checkpoint_from_before_the_moe_fields_left_the_config_resumes(tmp_path):
    """Dense configs once carried the MoE fields (num_experts 0, ...); a checkpoint of such a run is still this run's.
    A real difference (another hidden size, another data seed) is still refused, naming it."""
    from model import Qwen3Config
    from million import rundir
    mcfg = Qwen3Config.tiny()
    fp = rundir.fingerprint(mcfg, {"w": [2, 3]}, {"seed": 0}, "byte")
    old = json.loads(json.dumps(fp))
    old["model"].update(num_experts=0, num_experts_per_tok=8, moe_intermediate_size=768, mlp_only_layers=[])
    ckpt = tmp_path / "step_0000001"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text(json.dumps({"step": 1, "files": {}, "fingerprint": old}))
    rundir.check_fingerprint(str(ckpt), fp)  # no error
    other = rundir.fingerprint(Qwen3Config.tiny(hidden_size=96), {"w": [2, 3]}, {"seed": 0}, "byte")
    with pytest.raises(SystemExit, match="belongs to another run.*hidden_size"):
        rundir.check_fingerprint(str(ckpt), other)
