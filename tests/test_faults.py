"""Faults during training: every rank stops together, or the job restarts and resumes.

The rows of docs/faults.md point here.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import yaml
from test_train import ROOT, criteo_config, small_config, train_resuming
from torch.distributed.checkpoint import filesystem
from torchrec import KeyedJaggedTensor

from embshard import checkpoint as ckpt
from embshard.app import train as train_module
from embshard.app.config import load_config
from embshard.app.train import TrainingError, train


def train_until_stopped(path: str) -> tuple[str, bool] | dict:
    try:
        return train(load_config(path))
    except TrainingError as e:
        return str(e), e.agreed


def with_malformed_line(tmp: Path, skip: bool, steps: int = 50) -> Path:
    config = criteo_config(tmp, steps=steps, lines=400)
    lines = (tmp / "train.tsv").read_text().splitlines()
    lines[330] = "1\tnot-a-number" + "\t1" * 38  # in rank 1's part, its 8th batch
    (tmp / "train.tsv").write_text("\n".join(lines) + "\n")
    data = yaml.safe_load(config.read_text())
    data.update(batch_size=16)
    data["data"]["skip_bad_lines"] = skip
    data["eval"] = {"every": 0}
    data["checkpoint"] = {"dir": str(tmp / "ckpt"), "every": 2, "keep": 2}
    config.write_text(yaml.safe_dump(data))
    return config


def test_a_malformed_line_on_one_rank_stops_every_rank_at_one_step(world, tmp_path):
    config = with_malformed_line(tmp_path, skip=False)
    (message, agreed), other = world(2).run(train_until_stopped, str(config))
    assert other == (message, agreed) and agreed
    assert "rank 1: " in message and "train.tsv:331: malformed Criteo line" in message
    stopped = int(message.split("stopped after step ")[1].split(":")[0])
    # The checkpoints before it are whole, and none was written at the failing step.
    latest = ckpt.latest(tmp_path / "ckpt")
    assert latest is not None and ckpt.describe(latest)["step"] < stopped
    assert ckpt.read_tensors(latest)


def test_skip_bad_lines_skips_and_counts(world, tmp_path):
    config = with_malformed_line(tmp_path, skip=True, steps=10)  # one pass over the file
    summaries = world(2).run(train_until_stopped, str(config))
    assert summaries[0] == summaries[1]
    assert summaries[0]["skipped_lines"] == 1 and summaries[0]["steps"] == 10


def test_a_malformed_held_out_line_stops_every_rank_at_start_up(world, tmp_path):
    config = criteo_config(tmp_path, steps=10, lines=400)
    lines = (tmp_path / "eval.tsv").read_text().splitlines()
    lines[600] = "1\tnot-a-number" + "\t1" * 38  # rank 1 reads it for its first eval
    (tmp_path / "eval.tsv").write_text("\n".join(lines) + "\n")
    (message, agreed), other = world(2).run(train_until_stopped, str(config))
    assert other == (message, agreed) and agreed
    assert message.startswith("reading the data: rank 1: ")
    assert "eval.tsv:601: malformed Criteo line" in message


def train_with_bad_ids_on_rank_1(path: str) -> tuple[str, bool] | dict:
    build = train_module.build_data

    def corrupted(config, rank, world):
        data = build(config, rank, world)
        clean = data.batch

        def batch(step: int):
            b = clean(step)
            if rank != 1 or step != 3:
                return b
            ids = b.sparse.values().clone()
            ids[0] = 10**9
            features = KeyedJaggedTensor(b.sparse.keys(), ids, lengths=b.sparse.lengths())
            return dataclasses.replace(b, sparse=features)

        data.batch = batch
        return data

    with mock.patch.object(train_module, "build_data", corrupted):
        return train_until_stopped(path)


def test_bad_ids_on_one_rank_stop_every_rank_at_the_step_that_uses_them(world, tmp_path):
    config = small_config(tmp_path, "ids.yaml", 10, tmp_path / "ckpt", 0)
    (message, agreed), other = world(2).run(train_with_bad_ids_on_rank_1, str(config))
    assert other == (message, agreed) and agreed
    assert message.startswith("step 4: forward")
    assert "rank 1: feature" in message and "id 1000000000 is outside" in message


def train_with_a_full_disk_on_rank_1(path: str) -> tuple[str, bool] | dict:
    """Rank 1's disk fills up in the middle of the step-10 save."""
    write = filesystem._write_item

    def full(transforms, stream, *args, **kwargs):
        if dist.get_rank() == 1 and "step_00000010" in str(getattr(stream, "name", "")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(transforms, stream, *args, **kwargs)

    with mock.patch.object(filesystem, "_write_item", full):
        return train_until_stopped(path)


def test_a_full_disk_during_a_save_stops_every_rank_and_keeps_the_last_checkpoint(world, tmp_path):
    saves = tmp_path / "ckpt"
    config = small_config(tmp_path, "full.yaml", 20, saves, 5)
    (message, agreed), other = world(2).run(train_with_a_full_disk_on_rank_1, str(config))
    assert other == (message, agreed) and agreed
    assert message.startswith("step 10: saving a checkpoint failed: rank 1: OSError")
    assert "No space left on device" in message
    assert ckpt.latest(saves).name == "step_00000005"
    assert ckpt.read_tensors(ckpt.latest(saves))


def workers_of(cli: subprocess.Popen) -> list[int]:
    found = subprocess.run(
        ["pgrep", "-P", str(cli.pid), "-f", "embshard.app.train"], capture_output=True, text=True
    ).stdout.split()
    assert found, "no worker processes found"
    return [int(pid) for pid in found]


def launch(config: Path, cwd: Path) -> subprocess.Popen:
    embshard = str(Path(sys.executable).parent / "embshard")
    return subprocess.Popen(
        [embshard, "train", str(config), "--nproc", "2", "--max-restarts", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
    )


def wait_for(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.is_dir() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.is_dir(), f"{path} did not appear in {seconds} s"


def test_a_stuck_rank_times_the_others_out_and_the_job_resumes(tmp_path):
    saves = tmp_path / "ckpt"
    config = small_config(tmp_path, "stuck.yaml", 400, saves, 20)
    data = yaml.safe_load(config.read_text())
    data["timeout_s"] = 10
    config.write_text(yaml.safe_dump(data))
    cli = launch(config, tmp_path)
    wait_for(saves / "step_00000040", 240)
    stopped_at = time.monotonic()
    os.kill(workers_of(cli)[-1], signal.SIGSTOP)
    output, _ = cli.communicate(timeout=300)
    assert cli.returncode == 0, output[-3000:]
    # The other rank failed in a named collective within the timeout, then the job
    # restarted from the last checkpoint and finished.
    assert "embshard: rank 0, step " in output, output[-3000:]
    assert "Traceback" not in output.split("embshard: rank 0, step ")[0][-2000:]
    assert "embshard: resumed from" in output
    assert ckpt.latest(saves).name == "step_00000400"
    assert time.monotonic() - stopped_at < 240


def test_a_rank_killed_mid_step_resumes_to_the_uninterrupted_weights(world, tmp_path):
    straight, saves = tmp_path / "straight", tmp_path / "ckpt"
    config = small_config(tmp_path, "long.yaml", 200, saves, 25)
    cli = launch(config, tmp_path)
    wait_for(saves / "step_00000050", 240)
    time.sleep(0.3)  # into a later step, not a save
    os.kill(workers_of(cli)[-1], signal.SIGKILL)
    output, _ = cli.communicate(timeout=300)
    assert cli.returncode == 0, output[-3000:]
    assert "embshard: resumed from" in output
    world(2).run(train_resuming, str(small_config(tmp_path, "b.yaml", 200, straight, 0)), False)
    expected = ckpt.read_tensors(ckpt.latest(straight))
    resumed = ckpt.read_tensors(ckpt.latest(saves))
    assert ckpt.latest(saves).name == "step_00000200" and expected.keys() == resumed.keys()
    for key, value in expected.items():
        assert torch.equal(value, resumed[key]), key


def test_fault_table_names_real_tests():
    table = (ROOT / "docs" / "faults.md").read_text()
    named = set(re.findall(r"`(test_\w+)`", table))
    assert len(named) >= 10
    assert not named - _all_test_names(), named - _all_test_names()


def _all_test_names() -> set[str]:
    found = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        for line in path.read_text().splitlines():
            if line.startswith("def test_"):
                found.add(line[4:].split("(")[0])
    return found
