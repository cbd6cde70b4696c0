"""Wall time and peak resident memory of ``embshard simulate``, one run at a time.

    PYTHONPATH=$PWD .venv/bin/python tools/bench_simulate.py configs/criteo_1tb.yaml \\
        --world-size 64 256 1024 --batches 8 [--mode full|streamed] [--out runs.json]

Each run is a child process (the command as a user types it, with ``--json``), timed
from its start to its end; its peak resident memory is the kernel's ``ru_maxrss`` of
that child alone (``os.wait4``). Prints one line a run and the machine: its cores,
memory and load average before and after (other work on the machine slows a run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMAND = [sys.executable, "-c", "from embshard.app.cli import main; main()", "simulate"]


def machine() -> str:
    total = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    return f"{os.cpu_count()} cores, {total / 2**30:.1f} GiB"


def run(config: str, world: int, batches: int, mode: str | None) -> dict:
    """One simulation in a child process: its wall seconds, peak RSS and report's head."""
    args = [config, "--world-size", str(world), "--batches", str(batches), "--json"]
    args += ["--mode", mode] if mode else []
    load = os.getloadavg()[0]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        child = subprocess.Popen(COMMAND + args, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        result = {"world_size": world, "batches": batches, "wall_s": round(wall, 1)}
        result["peak_rss_gib"] = round(usage.ru_maxrss / 2**20, 2)  # ru_maxrss: KiB
        result["load_before"], result["load_after"] = round(load, 1), round(os.getloadavg()[0], 1)
        if child.returncode:
            lines = err.read().strip().splitlines() or ["?"]
            return result | {"exit_code": child.returncode, "error": lines[-1]}
        report = json.load(out)
    return result | {"mode": report["mode"], "simulated_s": round(report["seconds_taken"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config")
    parser.add_argument("--world-size", type=int, nargs="+", required=True)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--mode", choices=["full", "streamed"])
    parser.add_argument("--out", help="Also write the runs here (JSON).")
    args = parser.parse_args()
    print(f"machine: {machine()}", flush=True)
    runs = []
    for world in args.world_size:
        result = run(args.config, world, args.batches, args.mode)
        runs.append(result)
        print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
