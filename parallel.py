"""Context parallelism (zigzag ring attention) and FSDP2 sharding, as plain functions.

Process groups and meshes are passed in as arguments; nothing here holds global state.
"""
import torch
import torch.distributed as dist

# ---------------------------------------------------------------------------------------------
# Zigzag sharding and ring attention
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# FSDP2 and gradient clipping
# ---------------------------------------------------------------------------------------------
