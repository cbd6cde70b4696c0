"""The README's example is the file it names, runs under torchrun, and prints what it shows."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import embshard

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
EXAMPLE = ROOT / "examples" / "shard_tables.py"
TRAINING = ROOT / "examples" / "train_ebc.py"


def run_example(path: Path, log_dir: Path) -> list[str]:
    """Rank outputs of the example on 2 ranks; each rank's stdout goes to its own file,
    so lines cannot interleave."""
    launch = [
        "--standalone",
        "--nproc-per-node",
        "2",
        "--redirects",
        "1",
        "--log-dir",
        str(log_dir),
    ]
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *launch, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=log_dir,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [
        ln for log in sorted(log_dir.rglob("stdout.log")) for ln in log.read_text().splitlines()
    ]


@pytest.mark.parametrize("example", [EXAMPLE, TRAINING], ids=lambda p: p.name)
def test_readme_shows_the_example_files(example):
    assert f"```python\n{example.read_text()}```" in README


def test_example_output_matches_readme(tmp_path):
    printed = sorted(ln for ln in run_example(EXAMPLE, tmp_path) if ln.startswith("rank "))
    shown = re.findall(r"^    (rank .*)$", README, flags=re.M)
    assert printed == shown


def test_training_example_learns(tmp_path):
    steps = [ln for ln in run_example(TRAINING, tmp_path) if ln.startswith("step ")]
    assert len(steps) == 5
    losses = [ast.literal_eval(ln.split("loss per rank ")[1]) for ln in steps]
    assert all(late < early for early, late in zip(losses[0], losses[-1]))
    assert "keys ['uid', 'iid', 'last_iid']" in steps[0]


def test_config_plan_is_the_examples_plan():
    plan = embshard.ShardingPlan.load(ROOT / "configs" / "example_plan.yaml")
    assert plan == embshard.ShardingPlan(
        {
            "user": embshard.table_wise(0),
            "item": embshard.row_wise(),
            "ad": embshard.column_wise([1, 0], [16, 48]),
        }
    )
