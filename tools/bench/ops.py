"""The working ops and host syncs of one training step, counted as torch's dispatcher
hands them to the backends: on a GPU each working op is a kernel launch (or a
collective), so their number is the host time a step pays beyond the kernels' own.

The step is the module's forward (with TorchRec's wait on its awaitable, and the
output's values read), then backward from gradients of ones (what the bench's loss,
the sum of every output value, sends back), with the fused update. The loss and its
gradients are made outside the count: they are the user's, not the library's.

What counts: every op that a ``TorchDispatchMode`` sees (each call that reaches the
backends; an op's own inner calls are not seen again), forward and backward, except
the metadata-only ones, which launch nothing:

- views: any op whose schema returns an alias of an input that it does not write
  (``view``, ``as_strided``, ``select``, ``slice``, ``expand``, ``split``, ``unbind``,
  ``transpose``, ``detach``, ``alias``, ...), and ``_unsafe_view``;
- allocations: ``empty``, ``empty_like``, ``empty_strided``, ``new_empty``,
  ``new_empty_strided``, ``resize_``, and ``set_`` (a tensor pointed at storage);
- profiler markers (the ``profiler`` namespace: ``record_function``) and ``prim`` ops.

So ``lift_fresh`` (a tensor made from Python data by ``torch.tensor``, a copy from the
host on a GPU) counts, as do collectives (``c10d::``, a launch each), copies, fills
(``zeros``, ``full``) and ops on empty tensors (a count does not depend on the ids).

Host syncs, counted apart from the ops: ``aten._local_scalar_dense`` (what
``.item()``, ``bool()``, ``int()`` and ``float()`` of a tensor dispatch) and
``Tensor.tolist`` and ``Tensor.numpy``, which read a tensor's memory without a
dispatcher call (a ``TorchFunctionMode`` sees them). On a GPU each waits for the device.

This module imports torch (its modes subclass torch's); the bench imports it lazily.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .libraries import LIBRARIES, build, loss, output, values
from .workloads import make_inputs, make_plan, table_configs

# Metadata-only ops that are not views by their schema: allocations (memory, no
# kernel), a tensor pointed at storage, and a view that does not say so.
NOT_WORK = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::resize_",
        "aten::set_",
        "aten::_unsafe_view",
    }
)
MARKER_NAMESPACES = ("profiler::", "prim::")
HOST_READS = frozenset({"tolist", "numpy"})  # value reads that the dispatcher does not see
SCALAR_READ = "aten::_local_scalar_dense"

# Frames a site looks through: torch's machinery and the step's harness.
_MACHINERY = ("/torch/", "/typing_extensions.py", "/tools/bench/libraries.py")
_COUNTER = ("call_site", "add", "__torch_dispatch__", "__torch_function__")  # above an op


def is_view(func) -> bool:
    """An op whose output aliases an input that it does not write: a view."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def is_working(func) -> bool:
    """Whether an op does work on data (counts), or only metadata (does not)."""
    name = func._schema.name
    if name == SCALAR_READ or name.startswith(MARKER_NAMESPACES) or name in NOT_WORK:
        return False
    return name == "aten::lift_fresh" or not is_view(func)


def call_site() -> str:
    """The innermost Python frame of the step that made the op, outside torch:
    ``path:function`` (path from its package's root), or ``(autograd)`` for the
    backward of a built-in op, which has no Python frame of its own."""
    frame = sys._getframe(1)
    while frame is not None:
        path, name = frame.f_code.co_filename, frame.f_code.co_name
        if path == __file__:
            if name not in _COUNTER:
                break  # count_step: the step's own frames are all above
        elif not any(part in path for part in _MACHINERY):
            parts = Path(path).parts
            roots = [i for i, p in enumerate(parts) if p in ("embshard", "torchrec", "fbgemm_gpu")]
            short = "/".join(parts[roots[-1] :]) if roots else Path(path).name
            return f"{short}:{name}"
        frame = frame.f_back
    return "(autograd)"


class _Dispatched(TorchDispatchMode):
    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name == SCALAR_READ:
            self.tally.syncs += 1
        elif is_working(func):
            self.tally.add(str(func))
        return func(*args, **(kwargs or {}))


class _HostReads(TorchFunctionMode):
    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self.tally = tally

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in HOST_READS:
            self.tally.syncs += 1
        return func(*args, **(kwargs or {}))


@dataclass
class Tally:
    """What ran inside ``with Tally() as tally:`` on this thread: working ops by name
    (and by call site if ``sites``) and host syncs."""

    sites: bool = False
    ops: Counter = field(default_factory=Counter)
    syncs: int = 0
    _modes: tuple = field(default=(), init=False, repr=False)

    def add(self, op: str) -> None:
        self.ops[f"{op} @ {call_site()}" if self.sites else op] += 1

    def __enter__(self) -> Tally:
        self._modes = (_HostReads(self), _Dispatched(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


@dataclass(frozen=True)
class StepOps:
    """One rank's training step, counted: working ops by name (``op`` or, by site,
    ``op @ file:function``) and host syncs, forward and backward apart."""

    forward: dict[str, int]
    backward: dict[str, int]
    forward_syncs: int
    backward_syncs: int

    @property
    def ops(self) -> int:
        return sum(self.forward.values()) + sum(self.backward.values())

    @property
    def syncs(self) -> int:
        return self.forward_syncs + self.backward_syncs


def count_step(model, batch, sites: bool = False) -> StepOps:
    """Run one training step of ``model`` (either library's) on ``batch`` and count
    it. Collective when the model is sharded: every rank calls it. ``batch`` must be
    one no model has seen: a KeyedJaggedTensor keeps what it computed (its lengths per
    key), and TorchRec's step would skip computing it again."""
    with Tally(sites) as forward:
        outputs = values(output(model, batch))
    gradients = [torch.ones_like(v) for v in outputs]
    with Tally(sites) as backward:
        torch.autograd.backward(outputs, gradients)
    return StepOps(dict(forward.ops), dict(backward.ops), forward.syncs, backward.syncs)


def every_rank(counted: StepOps) -> list[StepOps]:
    """Every rank's count, in rank order, on every rank (collective)."""
    gathered: list[StepOps | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, counted)
    return gathered


def count_case(
    workload: str | dict, plan_name: str, ids: str = "uniform", steps: int = 2, sites: bool = False
) -> dict:
    """Both libraries on one cell of the bench (its tables, plan and inputs), counted
    on every rank after a warm-up step: ``steps`` steps on different ids, each
    library's entry the first step's count of every rank, and whether the other steps
    counted the same. Collective; a cell embshard refuses is skipped, as in the bench."""
    world = dist.get_world_size()
    configs = table_configs(workload)
    plan = make_plan(plan_name, configs, world)
    record = {"workload": workload, "plan": plan_name, "world_size": world, "ids": ids}
    try:
        models = {library: build(library, configs, plan, world) for library in LIBRARIES}
    except ValueError as refused:  # raised alike on every rank, before any collective
        record["skipped"] = f"embshard refuses it: {refused}"
        return record
    for library, model in models.items():
        # Fresh batches for each library: a KeyedJaggedTensor caches what it computed
        # (its lengths per key), which a second model would find done.
        batches = make_inputs(workload, dist.get_rank(), 1 + steps, ids)
        loss(model, batches[0]).backward()  # first-use work is not a step's
        counts = [every_rank(count_step(model, batch, sites)) for batch in batches[1:]]
        record[library] = counts[0]
        record[f"{library}_steps_agree"] = all(c == counts[0] for c in counts)
    return record
