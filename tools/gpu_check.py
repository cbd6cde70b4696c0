"""embshard's CUDA path, checked and measured in one command on a GPU machine.

    python tools/gpu_check.py --out gpu_report            # on a CUDA machine
    python tools/gpu_check.py --device cpu --quick --out /tmp/dry   # a dry run anywhere

It runs, each part on its own so that one failure leaves the others' results: the
stack's versions; in a one-rank world (NCCL on CUDA, gloo on CPU) on bench workload
(d), power-law ids, a training step of embshard against a bare FBGEMM TBE doing the
same lookups and update, and against TorchRec's DMP on the same plan, tables and
inputs, with kernels and host time a step; the forward lookup's bandwidth on tables
bigger than the caches against the device's copy bandwidth; a step with dynamic
tables against static ones (tools/bench_dynamic.py); then the tests marked ``cuda``
(pytest, their outcomes by name). Writes ``gpu_check.json`` and ``summary.txt`` to
``--out``, rewriting them after each part.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
# In this order: FBGEMM's id operations, the id map and dynamic tables, every layout
# (one rank, then several sharing the GPU, an empty batch last), FP16 tables,
# compressed all-to-alls and managed memory, quantized serving, the CUDA-only
# optimizers, training, 2-D groups.
CUDA_TESTS = (
    "tests/test_sparse_ops.py",
    "tests/test_id_map.py",
    "tests/test_dynamic.py",
    "tests/test_cuda.py",
    "tests/test_cuda_features.py",
    "tests/test_serving.py",
    "tests/test_cuda_optimizers.py",
    "tests/test_train_cuda.py",
    "tests/test_twod.py",
)
PLANS = ("table_wise", "row_wise", "column_wise", "mixed")

# Sizes of the measurements: full on a GPU, tiny for a dry run.
SIZES = {
    "full": {
        "workload": "d",
        "batches": (512, 8192),  # workload (d)'s own per-rank batch, and a GPU-sized one
        "steps": 30,
        "warmup": 10,
        "copy_bytes": 2 << 30,
        "dynamic": ("--steps", "10", "--warmup", "3"),
        "lookup": {"tables": 4, "rows": 1 << 22, "dim": 128, "batch": 16384, "pooling": 32},
    },
    "quick": {
        "workload": {"tables": [(1000, 16, 2), (500, 32, 3), (200, 16, 1)], "bags": "fixed"},
        "batches": (64, 32),  # two: the second cell compares weights the first trained
        "steps": 3,
        "warmup": 1,
        "copy_bytes": 16 << 20,
        "dynamic": ("--steps", "1", "--warmup", "1"),
        "lookup": {"tables": 2, "rows": 1 << 14, "dim": 32, "batch": 256, "pooling": 4},
    },
}


def stack(device: str) -> dict:
    import fbgemm_gpu
    import torch
    import torchrec

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_git": torch.version.git_version[:12],
        "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"),
        "torchrec": getattr(torchrec, "__version__", "?"),
        "device": device,
    }
    if device == "cuda":
        info |= {
            "gpu": torch.cuda.get_device_name(0),
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30,
        }
    return info


def cuda_tests(device: str, out: Path, budget: float) -> dict:
    """The tests marked ``cuda`` by outcome, read from pytest's lines as they stream to
    ``cuda_tests.log``: what ran survives a run stopped at ``budget`` seconds. A hung
    world fails its test in 120 s, with every rank's stacks in the log. On CPU they are
    only collected (they need a GPU)."""
    paths = [p for p in CUDA_TESTS if (ROOT / p).exists()]
    listed = ["-q", "--collect-only"] if device == "cpu" else ["-v"]  # a line a test
    command = [sys.executable, "-m", "pytest", *listed, "-p", "no:cacheprovider", "-m", "cuda"]
    if importlib.util.find_spec("pytest_timeout"):
        command.append("--timeout=170")  # beyond the world's own 120 s, which dumps stacks
    command += paths
    log = out / "cuda_tests.log"
    env = {**os.environ, "EMBSHARD_TEST_WORLD_TIMEOUT": "120"}
    with log.open("w") as sink:
        tests = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True)  # fmt: skip
        try:
            returncode = tests.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            os.killpg(tests.pid, signal.SIGKILL)  # pytest and the worlds it started
            returncode = tests.wait()
            sink.write(f"\n[gpu_check: stopped after {budget:.0f} s]\n")
    text = log.read_text()
    cases = outcomes(text)
    collected = len(re.findall(r"^tests/\S+::\S+$", text, re.M)) if device == "cpu" else None
    return {"returncode": returncode, "collected": collected, "cases": cases}


def outcomes(log: str) -> dict[str, str]:
    """Each test's outcome in pytest's ``-v`` lines: the first outcome word after its
    name, which the ranks' own output (on the same file) may push to a later line."""
    names = list(re.finditer(r"^(tests/\S+::\S+) ", log, re.M))
    cases = {}
    for name, following in zip(names, [*names[1:], None]):
        text = log[name.end() : following.start() if following else len(log)]
        if found := re.search(r"\b(PASSED|FAILED|ERROR|SKIPPED)\b", text):
            cases[name.group(1)] = found.group(1)
    return cases


def _init_world(device: str) -> None:
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
    )


def steps_vs_bare_tbe_and_torchrec(device: str, sizes: dict) -> list[dict]:
    import torch
    from bench.device import step_cells
    from bench.workloads import WORKLOADS

    records = []
    workload = sizes["workload"]
    name = workload if isinstance(workload, str) else "quick"
    spec = WORKLOADS[workload] if isinstance(workload, str) else workload
    for plan in PLANS:  # a plan that fails leaves the others' figures
        try:
            cells = step_cells(spec, sizes["batches"], plan, "power-law", sizes["steps"],
                               sizes["warmup"], torch.device(device))  # fmt: skip
        except Exception:
            records.append({"workload": name, "plan": plan, "error": traceback.format_exc()})
            continue
        records += [{"workload": name, **cell} for cell in cells]
        if device == "cuda":
            torch.cuda.empty_cache()
    return records


def bandwidth(device: str, sizes: dict) -> dict:
    import torch
    from bench.device import copy_bandwidth, lookup_bandwidth

    copy = copy_bandwidth(sizes["copy_bytes"], torch.device(device))
    figures = lookup_bandwidth(**sizes["lookup"], device=torch.device(device))
    figures["copy_bytes_per_s"] = copy
    for name in ("embshard", "bare_tbe"):
        figures[name]["fraction_of_copy"] = figures[name]["bytes_per_s"] / copy
    return figures


def dynamic_step(device: str, sizes: dict) -> dict:
    """tools/bench_dynamic.py at one rank: workload (d)'s step with its five largest
    tables dynamic, against the same step with static tables."""
    command = [sys.executable, str(ROOT / "tools" / "bench_dynamic.py"), "--device", device,
               "--world", "1", "--json", *sizes["dynamic"]]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout)


def summary(report: dict) -> str:
    lines = [f"stack: {report.get('stack', {}).get('result')}"]
    tests = report.get("cuda_tests", {}).get("result") or {}
    cases = tests.get("cases", {})
    failed = [n for n, outcome in cases.items() if outcome != "PASSED"]
    lines.append(
        f"cuda tests: {len(cases) - len(failed)} passed, {len(failed)} not"
        + (f" ({', '.join(failed)})" if failed else "")
        + (f"; collected {tests['collected']}" if tests.get("collected") is not None else "")
    )
    for cell in report.get("steps", {}).get("result") or []:
        if "error" in cell:
            last = cell["error"].strip().splitlines()[-1]
            lines.append(f"({cell['workload']}) {cell['plan']} FAILED: {last}")
            continue
        ours, theirs, bare = cell["embshard"], cell["torchrec"], cell["bare_tbe"]
        kernels = [(r.get("kernels") or {}).get("kernels") for r in (ours, theirs, bare)]
        lines.append(
            f"({cell['workload']}) batch {cell['batch']:>5} {cell['plan']:<12} ms/step embshard "
            f"{ours['median_ms']:.3f} torchrec {theirs['median_ms']:.3f} bare TBE "
            f"{bare['median_ms']:.3f} | x bare {cell['over_bare_tbe']:.2f} "
            f"throughput vs torchrec {cell['throughput_ratio']:.2f} | host ms "
            f"{ours['host_ms']:.3f}/{theirs['host_ms']:.3f} | kernels {kernels[0]}/{kernels[1]}"
            f"/{kernels[2]} | ops {ours['ops']}/{theirs['ops']}"
        )
    lookup = report.get("bandwidth", {}).get("result")
    if lookup:
        lines.append(
            f"lookup bandwidth ({lookup['table_bytes'] / 2**30:.1f} GiB of tables): embshard "
            f"{lookup['embshard']['bytes_per_s'] / 1e9:.0f} GB/s "
            f"({lookup['embshard']['fraction_of_copy']:.0%} of copy), bare TBE "
            f"{lookup['bare_tbe']['bytes_per_s'] / 1e9:.0f} GB/s "
            f"({lookup['bare_tbe']['fraction_of_copy']:.0%}); copy "
            f"{lookup['copy_bytes_per_s'] / 1e9:.0f} GB/s"
        )
        for name in ("embshard", "bare_tbe"):
            if found := lookup[name].get("kernels"):
                longest = "; ".join(f"{k} {ms:.3f}" for k, ms in found["longest"])
                lines.append(
                    f"  {name} forward: {found['kernels']} kernels, {found['copies']} copies, "
                    f"{found['device_ms']:.3f} device ms; longest: {longest}"
                )
    dynamic = report.get("dynamic", {}).get("result")
    if dynamic:
        lines.append(
            f"dynamic tables (bench_dynamic, one rank): static {dynamic['static_ms']} ms, "
            f"dynamic {dynamic['dynamic_ms']} ms a step, ratio {dynamic['ratio_wall']}"
        )
    for name, part in report.items():
        if part.get("error"):
            lines.append(f"{name} FAILED: {part['error'].strip().splitlines()[-1]}")
    return "\n".join(lines) + "\n"


def run_part(report: dict, name: str, out: Path, work: Callable[[], object]) -> None:
    start = time.perf_counter()
    try:
        report[name] = {"result": work()}
    except Exception:
        report[name] = {"error": traceback.format_exc()}
    report[name]["seconds"] = time.perf_counter() - start
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "summary.txt").write_text(summary(report))
    print(
        f"[{name}] {report[name]['seconds']:.1f} s"
        + (" FAILED" if "error" in report[name] else ""),
        flush=True,
    )


@click.command()
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True)
@click.option("--quick", is_flag=True, help="Tiny sizes: a dry run of every part.")
@click.option("--tests/--no-tests", "with_tests", default=True, help="Run the cuda tests.")
@click.option(
    "--tests-budget",
    type=click.FloatRange(min=1),
    default=420,
    show_default=True,
    help="Seconds the cuda tests may take in all; what ran by then is reported.",
)
@click.option(
    "--deadline",
    type=click.FloatRange(min=1),
    default=None,
    help="Seconds from the start by which everything ends: the tests get what is left.",
)
@click.option("--out", type=click.Path(file_okay=False), default="gpu_report", show_default=True)
def main(
    device: str,
    quick: bool,
    with_tests: bool,
    tests_budget: float,
    deadline: float | None,
    out: str,
) -> None:
    """Check and measure embshard's CUDA path; writes OUT/gpu_check.json and summary.txt."""
    start = time.monotonic()
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("no CUDA device here: use --device cpu for a dry run")
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    sizes = SIZES["quick" if quick else "full"]
    report: dict = {}
    run_part(report, "stack", path, lambda: stack(device))
    _init_world(device)
    run_part(report, "steps", path, lambda: steps_vs_bare_tbe_and_torchrec(device, sizes))
    run_part(report, "bandwidth", path, lambda: bandwidth(device, sizes))
    if device == "cuda":
        torch.cuda.empty_cache()  # the processes after this share the GPU
    run_part(report, "dynamic", path, lambda: dynamic_step(device, sizes))
    if deadline is not None:
        tests_budget = min(tests_budget, max(1.0, deadline - (time.monotonic() - start)))
    if with_tests:
        run_part(report, "cuda_tests", path, lambda: cuda_tests(device, path, tests_budget))
    print(summary(report), end="")
    from embshard.runtime.teardown import shutdown

    shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tools"))
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    main()
