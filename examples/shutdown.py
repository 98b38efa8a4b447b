"""The end of a training script run under torchrun: every rank leaves together, and none through interpreter teardown.

DeepSpeed keeps references to its process groups, so ``destroy_process_group()`` unregisters them but their
gloo worker threads live on until interpreter finalization, where a rank was seen to abort after all its work
was done ("terminate called without an active exception", SIGABRT; torchrun then reports the run failed). So,
once the ranks met and the groups are destroyed, the streams are flushed and the process leaves with
``os._exit``. Call it only after everything the script writes is closed and every engine is destroyed
(``engine.destroy()``: DeepSpeed's decoupled checkpoint writer commits the last save there): neither atexit
handlers nor destructors run.  The ranks meet first, so a rank that failed alone leaves the others waiting in
the barrier until torchrun stops them.
"""

import os
import sys


def exit_ranks(code: int = 0) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
