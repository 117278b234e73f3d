"""Keep DeepSpeed from compiling its shared-memory collective op in the test processes.

On the CPU accelerator, ``deepspeed.init_distributed`` JIT-compiles ``deepspeed_shm_comm`` (a
C++ extension) the first time it runs on a machine: about two minutes on a 2-core CI machine,
before the first test can start. The tests run on gloo, which does not need it; DeepSpeed falls
back to torch.distributed when the op is absent. Users' machines compile it once and cache it.
"""

from __future__ import annotations


def skip_shm_op() -> None:
    import importlib

    # not ``import deepspeed.comm.torch as m``: deepspeed.comm's attribute ``torch`` is torch
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    ds_torch.build_shm_op = lambda: None
