"""``embshard train`` on CUDA (NCCL) learns what it learns on the CPU (gloo).

The small config at world size 1, trained side by side with ``--device cuda`` and
``--device cpu``: the same data and the same initial weights (tables and dense layers
are initialized on the CPU), so the held-out AUCs differ only by the devices' float
rounding. Launched through the command line from the checkout (``embshard`` need not
be installed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
STEPS = 300
DONE = "embshard: done "
PATH = os.environ.get("PYTHONPATH")  # the checkout goes first; carried packages stay


def short_small_config(tmp: Path) -> Path:
    data = yaml.safe_load((ROOT / "configs" / "small.yaml").read_text())
    data.update(steps=STEPS)
    data["eval"] = {"every": STEPS, "batches": 8}
    data["logging"] = {"progress": False}
    path = tmp / "small_short.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def start_training(config: Path, device: str) -> subprocess.Popen:
    cli = [sys.executable, "-c", "from embshard.app.cli import main; main()"]
    return subprocess.Popen(
        [*cli, "train", str(config), "--nproc", "1", "--device", device],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=config.parent,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), PATH]))},
    )


def finished(run: subprocess.Popen) -> tuple[str, dict]:
    """The run's output and the summary it ends with."""
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, (out + err)[-3000:]
    done = [line for line in out.splitlines() if line.startswith(DONE)]
    assert len(done) == 1, out[-3000:]
    return out, json.loads(done[0].removeprefix(DONE))


@pytest.mark.cuda
def test_training_on_cuda_reaches_the_cpus_auc(tmp_path, capsys):
    config = short_small_config(tmp_path)
    runs = {device: start_training(config, device) for device in ("cuda", "cpu")}
    (cuda_out, on_cuda), (cpu_out, on_cpu) = finished(runs["cuda"]), finished(runs["cpu"])
    assert "embshard: dlrm on 1 rank, cuda (nccl), plan:" in cuda_out
    assert "embshard: dlrm on 1 rank, cpu (gloo), plan:" in cpu_out
    assert on_cuda["steps"] == on_cpu["steps"] == STEPS
    with capsys.disabled():  # the figures in gpu_check's log, whatever the outcome
        print(
            f"\neval AUC after {STEPS} steps: cuda {on_cuda['eval_auc']}, cpu {on_cpu['eval_auc']}"
        )
    assert on_cpu["eval_auc"] > 0.7, on_cpu  # it learned: the comparison means something
    assert abs(on_cuda["eval_auc"] - on_cpu["eval_auc"]) < 0.002, (on_cuda, on_cpu)
