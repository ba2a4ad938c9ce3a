"""One process of a world on torch's ``fake`` process group: the rank the
launcher checks build the real code on, on CPU.

Shared by ``check_torchtitan.py`` (and the checks that import it) and
``check_megatron_deepspeed.py``, which runs in a process of its own.
"""

from __future__ import annotations

import contextlib
import os

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextlib.contextmanager
def fake_rank(rank: int, world: int):
    """One process of ``world`` on torch's fake process group."""
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
