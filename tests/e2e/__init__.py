"""The end-to-end tier: `pytest tests/e2e` (`pytest tests`, the unit tier, leaves this folder out). Its tests launch
train.py under torchrun or python, the bench scripts and the README's commands, and inject faults into real runs
(tests/e2e/fault_run.py): about 15 minutes on 2 CPU cores.

A package, so that its files (named like the unit files they came from) import as e2e.test_train etc. beside the
unit tier's test_train: helpers shared within this tier are imported relatively (from .test_long_runs import ...),
the unit tier's by name (from test_rows import ...)."""
