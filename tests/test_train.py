"""The training job: Criteo-format training, SIGTERM, and the CLI end to end."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from oracle import Case, Table, global_batch, local_batches
from test_data import lines_per_rank, uneven_lines
from torchrec import EmbeddingBagCollection
from torchrec.models.dlrm import DLRM

import embshard
from embshard import checkpoint as ckpt
from embshard.app.config import load_config
from embshard.app.planning import plan_config
from embshard.app.train import describe_plan, local_loss, main, train

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
    data["data"] = {"type": "synthetic", "drift": {"turnover_steps": 20}}  # held out at the step
    data["tables"][0]["dynamic"] = {"buckets": 1000}  # user: raw ids over 63 bits, remapped
    data["eval"] = {"every": 15, "batches": 2}
    data["logging"] = {"metrics": "metrics.jsonl", "every": 10}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(data))
    run = run_cli("train", "tiny.yaml", "--nproc", "2", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "embshard: dlrm on 2 ranks, cpu (gloo), plan:" in run.stdout  # auto: no GPU each
    assert "per rank (table weights + rowwise_adagrad state + id maps):" in run.stdout
    assert "step 0: eval AUC" in run.stdout and "step 30: eval AUC" in run.stdout
    assert '"steps": 30' in run.stdout
    summary = json.loads(run.stdout.rsplit("embshard: done ", 1)[1].splitlines()[0])
    user = summary["dynamic"]["user"]
    assert user["live"] == user["admitted"] - user["evicted"] > 0 and user["overflow"] == 0
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3 + 3


def test_cuda_without_a_gpu_per_rank_is_refused_by_every_rank(monkeypatch, capsys):
    """Launched by torchrun itself (``embshard train`` refuses it before launching): each
    rank refuses alike, before any process group, in one line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    config = str(ROOT / "configs" / "small.yaml")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        assert main(["--config", config, "--device", "cuda"]) == 2
        assert not dist.is_initialized()
        assert capsys.readouterr().err == (
            "embshard: --device: cuda needs 2 CUDA devices for this host's 2 ranks (one "
            "each: NCCL refuses two ranks on one device); torch sees no CUDA device\n"
        )


def test_malformed_criteo_line_ends_the_job_with_its_location(tmp_path):
    config = criteo_config(tmp_path, steps=50, lines=400)
    lines = (tmp_path / "train.tsv").read_text().splitlines()
    lines[250] = "1\tnot-a-number" + "\t1" * 38
    (tmp_path / "train.tsv").write_text("\n".join(lines) + "\n")
    run = run_cli("train", str(config), "--nproc", "2", cwd=tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 1
    # Said once, by rank 0, for every rank; no traceback, no torchrun teardown table.
    assert output.count("train.tsv:251: malformed Criteo line") == 1, output
    assert "embshard: stopped after step " in output
    for noise in ("Traceback", "Root Cause", "failed (exitcode", "OMP_NUM_THREADS"):
        assert noise not in output, output


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


def train_resuming_quoting_stderr(path: str) -> tuple[dict, str]:
    with contextlib.redirect_stderr(io.StringIO()) as said:
        summary = train(load_config(path), resume=True)
    return summary, said.getvalue()


def test_resuming_without_a_checkpoint_warns_where_it_looked_and_starts_at_step_0(world, tmp_path):
    empty = tmp_path / "none_yet"
    config = small_config(tmp_path, "a.yaml", 2, empty, 0)
    (summary, said), (_, quiet) = world(2).run(train_resuming_quoting_stderr, str(config))
    assert said == f"embshard: warning: --resume: no checkpoint in {empty}: starting from step 0\n"
    assert quiet == "" and summary["steps"] == 2

    data = yaml.safe_load(config.read_text())
    del data["checkpoint"]
    config.write_text(yaml.safe_dump(data))
    (summary, said), _ = world(2).run(train_resuming_quoting_stderr, str(config))
    assert said == (
        "embshard: warning: --resume: the config has no checkpoint: section: starting from step 0\n"
    )
    assert summary["steps"] == 2


def train_with_torchrun_env(path: str, env: dict[int, dict[str, str]]) -> tuple[dict, str]:
    """``train`` with torchrun's variables set as ``env`` gives them for this rank."""
    mine = env.get(dist.get_rank(), {})
    saved = {k: os.environ.get(k) for k in mine}
    os.environ.update(mine)
    try:
        with contextlib.redirect_stdout(io.StringIO()) as said:
            return train(load_config(path)), said.getvalue()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value


def test_every_rank_resumes_from_the_checkpoint_rank_0_finds(world, tmp_path):
    """Each host's torchrun counts its own restarts: a host started afresh says 0 while
    the survivors say 1. Every rank must still resume, from the same checkpoint."""
    root = tmp_path / "ckpt"
    world(2).run(train_resuming, str(small_config(tmp_path, "a.yaml", 10, root, 10)), False)
    config = str(small_config(tmp_path, "b.yaml", 20, root, 10))
    survivor_restarted = {0: {"TORCHELASTIC_RESTART_COUNT": "1"}}
    found = world(2).run(train_with_torchrun_env, config, survivor_restarted)
    assert [summary["steps"] for summary, _ in found] == [20, 20]
    assert f"embshard: resumed from {root / 'step_00000010'} at step 10" in found[0][1]
    straight = tmp_path / "straight"
    world(2).run(train_resuming, str(small_config(tmp_path, "c.yaml", 20, straight, 10)), False)
    expected, resumed = (
        ckpt.read_tensors(ckpt.latest(straight)),
        ckpt.read_tensors(ckpt.latest(root)),
    )
    assert all(torch.equal(value, resumed[key]) for key, value in expected.items())


def test_a_job_continues_from_its_own_checkpoint_and_not_from_another_jobs(world, tmp_path):
    """torchrun counts no restart when a host joins or replaces one (a new rendezvous
    round): the job's own checkpoint says it is continuing."""
    root = tmp_path / "ckpt"
    job = {r: {"TORCHELASTIC_RUN_ID": "job-a"} for r in range(2)}
    world(2).run(train_with_torchrun_env, str(small_config(tmp_path, "a.yaml", 10, root, 10)), job)
    assert ckpt.read_description(ckpt.latest(root))["job"] == "job-a"
    copied = tmp_path / "copied"
    shutil.copytree(root, copied)
    another = {r: {"TORCHELASTIC_RUN_ID": "job-b"} for r in range(2)}
    config = str(small_config(tmp_path, "b.yaml", 20, copied, 10))
    (summary, said), _ = world(2).run(train_with_torchrun_env, config, another)
    assert "resumed" not in said and summary["steps"] == 20  # from step 0: not its checkpoint
    config = str(small_config(tmp_path, "c.yaml", 20, root, 10))
    (summary, said), _ = world(2).run(train_with_torchrun_env, config, job)
    assert f"embshard: resumed from {root / 'step_00000010'} at step 10" in said


def train_with_a_checkpoint_dir_per_rank(path: str) -> str:
    data = yaml.safe_load(Path(path).read_text())
    data["checkpoint"]["dir"] += f"_rank{dist.get_rank()}"
    mine = Path(path).with_name(f"rank{dist.get_rank()}.yaml")
    mine.write_text(yaml.safe_dump(data))
    try:
        train(load_config(str(mine)))
    except Exception as e:
        return str(e)
    return "trained"


def test_a_checkpoint_dir_that_is_not_shared_stops_every_rank_before_the_first_step(
    world, tmp_path
):
    config = small_config(tmp_path, "a.yaml", 10, tmp_path / "private", 5)
    said = world(2).run(train_with_a_checkpoint_dir_per_rank, str(config))
    assert (
        said[0]
        == said[1]
        == (
            "checking the checkpoint directory: rank 1 does not see the file rank 0 wrote in "
            f"checkpoint.dir {tmp_path / 'private_rank1'}: checkpoints need a directory on storage "
            "shared by every host"
        )
    )
    assert not list((tmp_path / "private_rank0").iterdir())  # no step, no marker left


def uneven_config(tmp: Path, steps: int, lines: list[str], eval_lines: list[str]) -> Path:
    """Criteo training and held-out files, batch 32, the planner's plan for any world."""
    data = yaml.safe_load((ROOT / "configs" / "criteo_sample.yaml").read_text())
    del data["plan"]
    (tmp / "train.tsv").write_text("\n".join(lines) + "\n")
    (tmp / "eval.tsv").write_text("\n".join(eval_lines) + "\n")
    data["data"].update(path=str(tmp / "train.tsv"), eval_path=str(tmp / "eval.tsv"))
    data.update(steps=steps, batch_size=32)
    data["eval"] = {"every": 1000, "batches": 100}
    data["logging"] = {"metrics": str(tmp / "metrics.jsonl"), "every": 1000, "progress": False}
    path = tmp / "uneven.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def train_passes(path: str, epochs: int) -> dict:
    """train() on ``epochs`` passes over the Criteo file (the config's ``data.epochs``)."""
    config = load_config(path)
    return train(replace(config, data=replace(config.data, epochs=epochs)))


def step_0_eval(tmp: Path) -> dict:
    (record,) = [json.loads(x) for x in (tmp / "metrics.jsonl").read_text().splitlines()[:1]]
    assert record["step"] == 0
    return record


def test_uneven_data_ends_together_after_every_pass(world, tmp_path):
    lines, eval_lines = uneven_lines(100, 4, seed=0), uneven_lines(60, 3, seed=1)
    counts = lines_per_rank(lines, 3)
    assert counts[1] <= 5 and min(counts[0], counts[2]) >= 95  # rank 1's part is short
    assert min(lines_per_rank(eval_lines, 3)) <= 4
    three, even = tmp_path / "three", tmp_path / "two"
    three.mkdir(), even.mkdir()
    config = uneven_config(three, 1000, lines, eval_lines)
    summaries = world(3).run(train_passes, str(config), 2, timeout=120)
    assert summaries[0] == summaries[1] == summaries[2]
    summary = summaries[0]
    assert summary["data_ended"] and summary["samples"] == 2 * len(lines)
    assert summary["steps"] == 2 * math.ceil(max(counts) / 32)
    assert math.isfinite(summary["loss"]) and math.isfinite(summary["eval_loss"])
    # The same samples split in two: the same count; the same model before training
    # (whatever the world size), so the same held-out AUC and loss over every line.
    halves = lines_per_rank(lines, 2)
    two = world(2).run(train_passes, str(uneven_config(even, 1000, lines, eval_lines)), 2)
    assert two[0]["samples"] == summary["samples"]
    assert two[0]["steps"] == 2 * math.ceil(max(halves) / 32)
    expected, got = step_0_eval(even), step_0_eval(three)
    assert abs(got["eval_auc"] - expected["eval_auc"]) < 1e-6
    assert abs(got["eval_loss"] - expected["eval_loss"]) < 1e-5


def test_uneven_passes_cycle_in_step_until_the_steps_are_done(world, tmp_path):
    lines = uneven_lines(100, 4, seed=0)
    counts = lines_per_rank(lines, 3)
    per_pass = math.ceil(max(counts) / 32)
    config = uneven_config(tmp_path, 2 * per_pass + 1, lines, sample_lines(50, seed=1))
    summaries = world(3).run(train_from, str(config), timeout=120)
    assert summaries[0] == summaries[1] == summaries[2]
    assert "data_ended" not in summaries[0] and summaries[0]["steps"] == 2 * per_pass + 1
    first_step = sum(min(32, n) for n in counts)
    assert summaries[0]["samples"] == 2 * len(lines) + first_step


TABLES = (Table("a", 40, 8, ("f_a",)), Table("b", 30, 8, ("f_b1", "f_b2"), mean=True))


def train_uneven_batches(sizes: list[tuple[int, ...]], lr: float) -> list[float]:
    """SGD steps with local_loss on uneven batches (empty ones included), next to the
    unsharded model on the global batch with the mean BCE over its samples; the
    largest difference of each weight (dense and tables) at the end."""
    rank = dist.get_rank()
    plan = embshard.ShardingPlan({"a": embshard.row_wise(), "b": embshard.column_wise([2, 0])})
    torch.manual_seed(0)
    oracle = DLRM(EmbeddingBagCollection(tables=[t.config() for t in TABLES]), 5, [8, 8], [8, 1])
    model = embshard.shard_model(copy.deepcopy(oracle), plan, optimizer=embshard.SGD(lr=lr))
    dense_opt = torch.optim.SGD(model.parameters(), lr=lr)
    oracle_opt = torch.optim.SGD(oracle.parameters(), lr=lr)
    for step, batch_sizes in enumerate(sizes):
        batches = local_batches(Case(TABLES, plan, batch_sizes, seed=step), step)
        generator = torch.Generator().manual_seed(step)
        dense = torch.randn(sum(batch_sizes), 5, generator=generator)
        labels = torch.randint(0, 2, (sum(batch_sizes),), generator=generator).float()
        mine = slice(sum(batch_sizes[:rank]), sum(batch_sizes[: rank + 1]))
        logits = model(dense[mine], batches[rank]).squeeze(1)
        local_loss(logits, labels[mine], sum(batch_sizes)).backward()
        dense_opt.step()
        dense_opt.zero_grad()
        all_logits = oracle(dense, global_batch(batches)).squeeze(1)
        F.binary_cross_entropy_with_logits(all_logits, labels).backward()
        oracle_opt.step()
        oracle_opt.zero_grad()
    oracle_params = dict(oracle.named_parameters())
    gaps = [float((p - oracle_params[n]).abs().max()) for n, p in model.module.named_parameters()]
    for path, sharded in embshard.modules.shard_model.sharded_collections(model.module).items():
        for table, weight in sharded.weights.items():
            expected = oracle.get_submodule(path).embedding_bags[table].weight
            gaps.append(float((embshard.gather_table(weight) - expected).abs().max()))
    return gaps


def test_empty_and_partial_batches_train_like_the_global_batch(world):
    # Rank 2, then rank 0, has no samples; the oracle is the mean over the real ones.
    sizes = [(5, 2, 0), (0, 3, 4), (1, 0, 6)]
    for gaps in world(3).run(train_uneven_batches, sizes, 0.5):
        assert len(gaps) > 2 and all(gap < 1e-5 for gap in gaps), gaps  # NaN fails too


def test_start_up_memory_is_what_the_planner_counts():
    config = load_config(ROOT / "configs" / "small.yaml")
    plan, report = plan_config(config, 2)
    lines = describe_plan(plan, config, 2).splitlines()
    assert "per rank (table weights + rowwise_adagrad state):" in lines
    # Rank 0 holds item (50,000 rows) and copies of category (1,000) and device (200)
    # of 16 columns, each row with one row-wise Adagrad accumulator: 4 bytes x 51,200
    # x 17 = 3.32 MiB.
    assert report.ranks[0].memory == 4 * 51_200 * 17
    shards = "item[0:+50000, 0:+16], category[0:+1000, 0:+16], device[0:+200, 0:+16]"
    assert f"  rank 0: 3.3 MiB  {shards}" in lines
