"""The training job: Criteo-format training, SIGTERM, and the CLI end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from embshard import checkpoint as ckpt
from embshard.config import load_config
from embshard.train import train

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from make_criteo_sample import sample_lines  # noqa: E402


def criteo_config(tmp: Path, steps: int, metrics: str | None = None, lines: int = 6000) -> Path:
    data = yaml.safe_load((ROOT / "configs" / "criteo_sample.yaml").read_text())
    (tmp / "train.tsv").write_text("\n".join(sample_lines(lines, seed=0)) + "\n")
    (tmp / "eval.tsv").write_text("\n".join(sample_lines(1000, seed=1)) + "\n")
    data["data"].update(path=str(tmp / "train.tsv"), eval_path=str(tmp / "eval.tsv"))
    data.update(steps=steps, batch_size=128)
    data["eval"] = {"every": steps // 2, "batches": 3}
    data["logging"] = {"metrics": metrics, "every": 10, "progress": False}
    path = tmp / "criteo.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def train_from(path: str) -> dict:
    return train(load_config(path))


def test_criteo_sample_training(world, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    config = criteo_config(tmp_path, steps=120, metrics=str(metrics))
    summaries = world(2).run(train_from, str(config))
    assert summaries[0] == summaries[1]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [r for r in records if "eval_auc" in r]
    assert [r["step"] for r in evals] == [0, 60, 120]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert evals[-1]["eval_auc"] > 0.6
    assert [r["step"] for r in records if "loss" in r] == list(range(10, 121, 10))


def stop_rank_1_by_sigterm(path: str) -> dict:
    if dist.get_rank() == 1:
        threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    return train(load_config(path))


def test_sigterm_on_one_rank_stops_every_rank(world, tmp_path):
    data = yaml.safe_load((ROOT / "configs" / "small.yaml").read_text())
    data.update(steps=100_000, batch_size=64)
    data["eval"] = {"every": 0}
    data["logging"] = {"progress": False}
    data["checkpoint"] = {"dir": str(tmp_path / "ckpt")}
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(data))
    summaries = world(2).run(stop_rank_1_by_sigterm, str(path), timeout=120)
    assert all(s.get("stopped") for s in summaries)
    assert summaries[0]["steps"] == summaries[1]["steps"] < 100_000
    assert ckpt.describe(tmp_path / "ckpt")["step"] == summaries[0]["steps"]


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).parent / "embshard"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def test_cli_trains_and_reports(tmp_path):
    data = yaml.safe_load((ROOT / "configs" / "small.yaml").read_text())
    data.update(steps=30, batch_size=64)
    data["eval"] = {"every": 15, "batches": 2}
    data["logging"] = {"metrics": "metrics.jsonl", "every": 10}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(data))
    run = run_cli("train", "tiny.yaml", "--nproc", "2", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "embshard: dlrm on 2 ranks, plan:" in run.stdout and "per rank:" in run.stdout
    assert "step 0: eval AUC" in run.stdout and "step 30: eval AUC" in run.stdout
    assert '"steps": 30' in run.stdout
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3 + 3


def test_malformed_criteo_line_ends_the_job_with_its_location(tmp_path):
    config = criteo_config(tmp_path, steps=50, lines=400)
    lines = (tmp_path / "train.tsv").read_text().splitlines()
    lines[250] = "1\tnot-a-number" + "\t1" * 38
    (tmp_path / "train.tsv").write_text("\n".join(lines) + "\n")
    run = run_cli("train", str(config), "--nproc", "2", cwd=tmp_path)
    assert run.returncode != 0
    assert "train.tsv:251: malformed Criteo line" in run.stdout + run.stderr


def small_config(tmp: Path, name: str, steps: int, ckpt_dir: Path, every: int) -> Path:
    data = yaml.safe_load((ROOT / "configs" / "small.yaml").read_text())
    data.update(steps=steps, batch_size=32)
    data["eval"] = {"every": 0}
    data["logging"] = {"progress": False}
    data["checkpoint"] = {"dir": str(ckpt_dir), "every": every, "keep": 2}
    path = tmp / name
    path.write_text(yaml.safe_dump(data))
    return path


def train_resuming(path: str, resume: bool) -> dict:
    return train(load_config(path), resume=resume)


def test_resume_reaches_the_uninterrupted_weights(world, tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    world(2).run(train_resuming, str(small_config(tmp_path, "a.yaml", 20, straight, 10)), False)
    world(2).run(train_resuming, str(small_config(tmp_path, "b.yaml", 10, interrupted, 10)), False)
    summaries = world(2).run(
        train_resuming, str(small_config(tmp_path, "c.yaml", 20, interrupted, 10)), True
    )
    assert summaries[0]["steps"] == 20
    expected = ckpt.read_tensors(ckpt.latest(straight))
    resumed = ckpt.read_tensors(ckpt.latest(interrupted))
    assert ckpt.latest(interrupted).name == "step_00000020"
    assert expected.keys() == resumed.keys()
    assert any(k.startswith("dense_optimizer.") for k in expected)
    assert any(k.startswith("sparse_optimizer.") for k in expected)
    for key, value in expected.items():
        assert torch.equal(value, resumed[key]), key
    # And on another world size, under the default plan for 3 ranks.
    on_three = world(3).run(
        train_resuming, str(small_config(tmp_path, "d.yaml", 30, interrupted, 10)), True
    )
    assert on_three[0]["steps"] == 30 and ckpt.latest(interrupted).name == "step_00000030"


def test_killed_rank_restarts_from_the_last_checkpoint(tmp_path):
    saves = tmp_path / "ckpt"
    config = small_config(tmp_path, "long.yaml", 300, saves, 25)
    cli = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "embshard"),
            "train",
            str(config),
            "--nproc",
            "2",
            "--max-restarts",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    deadline = time.monotonic() + 240
    while not (saves / "step_00000050").is_dir() and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = subprocess.run(
        ["pgrep", "-P", str(cli.pid), "-f", "embshard.train"], capture_output=True, text=True
    ).stdout.split()
    assert workers, "no worker processes found"
    os.kill(int(workers[-1]), signal.SIGKILL)
    output, _ = cli.communicate(timeout=300)
    assert cli.returncode == 0, output[-3000:]
    assert "embshard: resumed from" in output
    assert ckpt.latest(saves).name == "step_00000300"
