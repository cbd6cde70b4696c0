"""Long-lived gloo process worlds shared by many test cases.

Starting a process that imports torch, FBGEMM and TorchRec takes seconds on a small
machine, so each world size is started once per session and runs test functions on
all its ranks: ``world.run(fn, *args)`` calls ``fn(*args)`` on every rank and returns
the per-rank results. ``fn`` must be a module-level function (it is pickled by name).
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

COLLECTIVE_TIMEOUT = timedelta(seconds=60)
# How long World.run waits for a rank before it dumps every rank's stacks and fails.
RUN_TIMEOUT = float(os.environ.get("EMBSHARD_TEST_WORLD_TIMEOUT", 180))


def _serve(
    rank: int, size: int, store_path: str, conn: Any, backend: str, cuda: bool, env: dict
) -> None:
    os.environ.update(env)  # before embshard reads it
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # World.run's stacks of a hang
    if cuda:
        torch.cuda.set_device(0)  # one GPU: every rank shares it
    dist.init_process_group(
        backend,
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    while (job := conn.recv()) is not None:
        fn, args = job
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()
    # Skip the interpreter's teardown, where a rank whose gloo threads still hold
    # tensors can hang or abort (embshard.shutdown's reason): the world's work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class World:
    """``size`` ranks in their own processes, one process group of ``backend``;
    ``cuda``: each rank's current device is GPU 0; ``env``: set in each rank's
    environment before it imports torch."""

    def __init__(
        self, size: int, backend: str = "gloo", cuda: bool = False, env: dict | None = None
    ) -> None:
        self.size = size
        self._dir = tempfile.TemporaryDirectory(prefix=f"embshard-world{size}-")
        store = os.path.join(self._dir.name, "store")
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve,
                args=(rank, size, store, child, backend, cuda, env or {}),
                daemon=True,
            )
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = RUN_TIMEOUT) -> list[Any]:
        """``fn(*args)`` on every rank; raises with every failing rank's traceback."""
        for conn in self._conns:
            conn.send((fn, args))
        results, errors = [], []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(timeout):
                self._dump_stacks()
                self.close()
                raise TimeoutError(
                    f"rank {rank} did not finish {fn.__name__} in {timeout}s "
                    "(every rank's stacks are on stderr)"
                )
            status, value = conn.recv()
            if status == "error":
                errors.append(f"--- rank {rank} ---\n{value}")
            results.append(value)
        if errors:
            # The other ranks may be out of step now: start the next test on a fresh world.
            self.close()
            raise AssertionError(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return results

    def _dump_stacks(self) -> None:
        """Every rank's Python stacks, on its stderr: where a hung rank waits."""
        for proc in self._procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(2)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    conn.send(None)
        deadline = time.monotonic() + 10  # for all the ranks, not each
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
        self._dir.cleanup()
