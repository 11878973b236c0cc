"""The LR schedule of a run resumed with flags changed, in-process. The runs that survive their surroundings (a lost
terminal, a frozen peer, a second launch...) are real train.py runs, in tests/e2e/test_survival.py."""
import dataclasses
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_lr_schedule_continues_without_a_jump():
    """Raised --max_steps mid-cosine: the next step's LR is below the last one, and it reaches the floor at the new
    end; unchanged, the schedule is the plain warmup + cosine."""
    sys.path.insert(0, ROOT)
    from million import config
    import train
    from million.resume import schedule_anchor
    cfg = config.TrainConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=2, max_steps=10)
    plain = [train.lr_at(s, cfg) for s in range(1, 11)]
    assert plain[:2] == [0.5, 1.0] and plain[-1] == pytest.approx(0.1)
    longer = dataclasses.replace(cfg, max_steps=20)
    anchor = schedule_anchor(longer, dataclasses.asdict(cfg), None, 6, train.lr_at)
    assert anchor == [6, pytest.approx(plain[5])]
    after = [train.lr_at(s, longer, anchor) for s in range(7, 21)]
    assert plain[5] > after[0] > after[1] and after[-1] == pytest.approx(0.1)
    assert train.lr_at(7, longer) > plain[5]  # what recomputing the cosine would have done: a jump up
