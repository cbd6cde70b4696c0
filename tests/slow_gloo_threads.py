"""Run a script as ``__main__`` on a rank whose gloo threads are slow, as on a busy
machine: ``python tests/slow_gloo_threads.py SCRIPT [ARGS...]`` (under torchrun).

The rank is pinned to one CPU and every thread ``init_process_group`` starts (gloo's
workers among them) runs at SCHED_IDLE, so such a thread runs only while the main
thread waits. A worker that finished a collective is then still holding its tensors
when the script ends, which is the window in which torch 2.13 aborts a process at
exit (docs/faults.md). The script's globals are kept, as a plain script's are, until
the interpreter's teardown.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading

import torch.distributed as dist


def _slow_threads(init):
    def init_process_group(*args, **kwargs):
        init(*args, **kwargs)
        main = threading.get_native_id()
        for tid in map(int, os.listdir("/proc/self/task")):
            if tid != main:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))

    return init_process_group


if __name__ == "__main__":
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[int(os.environ["LOCAL_RANK"]) % len(cpus)]})
    dist.init_process_group = _slow_threads(dist.init_process_group)
    sys.argv = sys.argv[1:]
    script_globals = runpy.run_path(sys.argv[0], run_name="__main__")
