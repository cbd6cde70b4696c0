"""Training across hosts, played by network namespaces on this machine (tests/hosts.py):
equal to the one-host run bit for bit, and a host lost or added mid-training costs
only the steps since the last checkpoint."""

from __future__ import annotations

import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from hosts import Host, hosts
from test_train import train_resuming

from embshard import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
EMBSHARD = str(Path(sys.executable).parent / "embshard")
PORT = 29471


@pytest.fixture(scope="module")
def two_hosts():
    with hosts(2) as found:
        yield found


def job_config(tmp: Path, name: str, steps: int, ckpt_dir: Path) -> Path:
    data = yaml.safe_load((ROOT / "configs" / "small.yaml").read_text())
    data.update(steps=steps, batch_size=32)
    data["eval"] = {"every": 0}
    data["logging"] = {"progress": False}
    data["checkpoint"] = {"dir": str(ckpt_dir), "every": 10, "keep": 100}
    path = tmp / name
    path.write_text(yaml.safe_dump(data))
    return path


def start(host: Host, hosts_: list[Host], config: Path, log: Path, *extra: str):
    endpoint = f"{hosts_[0].address}:{PORT}"
    args = [EMBSHARD, "train", str(config), "--rdzv-endpoint", endpoint]
    return host.start([*args, "--local-addr", host.address, *extra], log)


def finish(processes, logs, timeout: float = 300) -> None:
    for process, log in zip(processes, logs):
        assert process.wait(timeout=timeout) == 0, log.read_text()[-3000:]


def one_host(world, config: Path, nproc: int, resume: bool = False) -> None:
    """``config`` trained by ``nproc`` ranks of one host: the test session's shared
    world of them, running what each rank of ``embshard train`` runs."""
    world(nproc).run(train_resuming, str(config), resume)


def assert_same_weights(a: Path, b: Path) -> None:
    expected, found = ckpt.read_tensors(ckpt.latest(a)), ckpt.read_tensors(ckpt.latest(b))
    assert expected.keys() == found.keys()
    for key, value in expected.items():
        assert torch.equal(value, found[key]), key


@pytest.mark.parametrize("nproc", [1, 2])
def test_two_hosts_train_as_one_host_does(two_hosts, world, tmp_path, nproc):
    config = job_config(tmp_path, "two.yaml", 20, tmp_path / "two")
    logs = [tmp_path / f"host{i}.log" for i in range(2)]
    counts = ("--nproc", str(nproc), "--nnodes", "2")
    finish([start(h, two_hosts, config, log, *counts) for h, log in zip(two_hosts, logs)], logs)
    one_host(world, job_config(tmp_path, "one.yaml", 20, tmp_path / "one"), 2 * nproc)
    assert_same_weights(tmp_path / "one", tmp_path / "two")
    assert f"on {2 * nproc} ranks" in logs[0].read_text()


def resumed_step(log: Path) -> int:
    found = re.findall(r"embshard: resumed from \S+ at step (\d+)", log.read_text())
    assert len(found) == 1, log.read_text()[-3000:]
    return int(found[0])


def continued_alone(world, tmp: Path, config: Path, root: Path, step: int, nproc: int) -> Path:
    """The run from ``root``'s checkpoint of ``step`` to the end, uninterrupted, on one
    host with ``nproc`` ranks."""
    alone = tmp / "alone"
    shutil.copytree(root / f"step_{step:08d}", alone / f"step_{step:08d}")
    data = yaml.safe_load(config.read_text())
    data["checkpoint"]["dir"] = str(alone)
    (tmp / "alone.yaml").write_text(yaml.safe_dump(data))
    one_host(world, tmp / "alone.yaml", nproc, resume=True)
    return alone


def wait_for(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_dir():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


RESTARTING = ("--nproc", "1", "--nnodes", "2", "--max-restarts", "1")


def past_step_20(two_hosts: list[Host], tmp_path: Path) -> tuple[Path, Path, list[Path], list]:
    """A 200-step job on both hosts, one rank each, restarting once, once its step-20
    checkpoint is saved: its checkpoint root, config, hosts' logs and commands."""
    root = tmp_path / "ckpt"
    config = job_config(tmp_path, "job.yaml", 200, root)
    logs = [tmp_path / f"host{i}.log" for i in range(2)]
    running = [start(h, two_hosts, config, log, *RESTARTING) for h, log in zip(two_hosts, logs)]
    wait_for(root / "step_00000020")
    return root, config, logs, running


def test_a_host_lost_and_restarted_resumes_every_rank_from_the_last_checkpoint(
    two_hosts, world, tmp_path
):
    root, config, logs, running = past_step_20(two_hosts, tmp_path)
    two_hosts[1].kill_everything()  # its agent and its worker
    running[1].wait(timeout=30)
    time.sleep(2)  # the survivor's agent sees its worker fail and waits for a new round
    running[1] = start(two_hosts[1], two_hosts, config, logs[1], *RESTARTING)
    finish(running, logs)
    step = resumed_step(logs[0])
    assert 20 <= step < 200 and ckpt.latest(root).name == "step_00000200"
    assert_same_weights(continued_alone(world, tmp_path, config, root, step, 2), root)


def test_the_survivor_restarted_last_resumes_every_rank_from_the_last_checkpoint(
    two_hosts, world, tmp_path
):
    """Host B is lost; the survivor, host A (which hosts the rendezvous), is stopped too
    and comes back after B: two fresh agents, no restart counted, and the job still
    continues from its own last checkpoint."""
    root, config, logs, running = past_step_20(two_hosts, tmp_path)
    for host, process in zip(reversed(two_hosts), reversed(running)):  # B, then A
        host.kill_everything()
        process.wait(timeout=30)
    lost = start(two_hosts[1], two_hosts, config, logs[1], *RESTARTING)
    time.sleep(3)  # B waits for the rendezvous host
    survivor = start(two_hosts[0], two_hosts, config, logs[0], *RESTARTING)
    finish([survivor, lost], logs)
    said = "".join(log.read_text() for log in logs)
    found = re.findall(r"embshard: resumed from \S+ at step (\d+)", said)
    assert len(found) == 1, said[-3000:]
    step = int(found[0])
    assert 20 <= step < 200 and ckpt.latest(root).name == "step_00000200"
    assert_same_weights(continued_alone(world, tmp_path, config, root, step, 2), root)


def test_a_host_added_continues_the_job_from_its_last_checkpoint(two_hosts, world, tmp_path):
    """The first host trains alone until the second joins; the job then continues with
    two ranks, until a SIGTERM stops it (the steps are many: the first host must not
    finish before the second has joined)."""
    root = tmp_path / "ckpt"
    config = job_config(tmp_path, "job.yaml", 100_000, root)
    logs = [tmp_path / f"host{i}.log" for i in range(2)]
    counts = ("--nproc", "1", "--nnodes", "1:2")
    first = start(two_hosts[0], two_hosts, config, logs[0], *counts)
    wait_for(root / "step_00000020")
    second = start(two_hosts[1], two_hosts, config, logs[1], *counts)
    deadline = time.monotonic() + 240
    while "resumed from" not in logs[0].read_text():
        assert time.monotonic() < deadline and first.poll() is None, logs[0].read_text()[-3000:]
        time.sleep(0.5)
    step = resumed_step(logs[0])
    wait_for(root / f"step_{(step // 10 + 2) * 10:08d}")  # two ranks have trained
    two_hosts[0].signal_ranks(signal.SIGTERM)  # every rank stops after the step in flight
    finish([first, second], logs)
    assert "on 1 rank, cpu" in logs[0].read_text() and "on 2 ranks, cpu" in logs[0].read_text()
    end = ckpt.read_description(ckpt.latest(root))["step"]
    assert step >= 20 and end > step + 10
    data = yaml.safe_load(config.read_text())
    data["steps"] = end
    config.write_text(yaml.safe_dump(data))
    assert_same_weights(continued_alone(world, tmp_path, config, root, step, 2), root)
