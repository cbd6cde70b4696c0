"""Ending a rank's process: every rank together, and without the interpreter teardown
in which gloo's worker threads can abort or hang the process."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

import torch.distributed as dist


def shutdown(code: int = 0, *, barrier: bool = True) -> NoReturn:
    """End this rank's process with exit status ``code``: the last call of a script,
    on every rank, in place of ``dist.destroy_process_group()``.

    It waits for the other ranks (not with ``barrier=False``: for a rank that fails
    alone, when the others may be gone), destroys the process group if one is left,
    then does what a normal exit does first (waits for non-daemon threads, runs the
    ``atexit`` handlers, flushes stdout and stderr) and ends the process with
    ``os._exit``, skipping the interpreter's teardown. Nothing after it runs, not even
    ``finally`` blocks; close the files you wrote. A failed barrier (a rank gone)
    raises.

    Why: with torch 2.13, a gloo worker thread can still hold a finished collective's
    tensors after the call that ran it returned, and needs the GIL to free them.
    ``DistributedDataParallel`` (``shard_model`` wraps the dense part in it) keeps the
    process group and its threads alive after ``destroy_process_group``; when such a
    thread asks for the GIL during the interpreter's teardown, CPython ends it inside
    a C++ destructor and the process aborts ("terminate called without an active
    exception"); when the model is freed while such a thread waits, its reducer joins
    the threads holding the GIL, and the process hangs (docs/faults.md).
    """
    waiting = {threading.current_thread(), threading.main_thread()}
    for thread in threading.enumerate():
        if thread not in waiting and not thread.daemon:
            thread.join()
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
