"""The README's example is the file it names, runs under torchrun, and prints what it shows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import embshard

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
EXAMPLE = ROOT / "examples" / "shard_tables.py"


def test_readme_shows_the_example_file():
    assert f"```python\n{EXAMPLE.read_text()}```" in README


def test_example_output_matches_readme(tmp_path):
    # Each rank's stdout goes to its own file, so lines cannot interleave.
    launch = ["--nproc-per-node", "2", "--redirects", "1", "--log-dir", str(tmp_path)]
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *launch, str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [ln for log in tmp_path.rglob("stdout.log") for ln in log.read_text().splitlines()]
    printed = sorted(ln for ln in lines if ln.startswith("rank "))
    shown = re.findall(r"^    (rank .*)$", README, flags=re.M)
    assert printed == shown


def test_config_plan_is_the_examples_plan():
    plan = embshard.ShardingPlan.load(ROOT / "configs" / "example_plan.yaml")
    assert plan == embshard.ShardingPlan(
        {
            "user": embshard.table_wise(0),
            "item": embshard.row_wise(),
            "ad": embshard.column_wise([1, 0], [16, 48]),
        }
    )
