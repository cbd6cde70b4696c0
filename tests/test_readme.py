"""The README and docs/ show what the code does.

Every fenced Python block on a page is a file in examples/, every example runs under
torchrun and prints what its page shows, the README's example agrees with an
unsharded TorchRec oracle, the `embshard plan` transcripts are the command's output,
and the files, links, make targets and CLI options the pages name exist.
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM

import embshard
from embshard import checkpoint
from embshard.app.cli import main as cli
from embshard.app.show import draw_table
from embshard.storage.init import init_shard

ROOT = Path(__file__).resolve().parents[1]
PAGES = {
    p.relative_to(ROOT): p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
}
README = PAGES[Path("README.md")]
API = PAGES[Path("docs/api.md")]
PLANNING = PAGES[Path("docs/planning.md")]
EXAMPLES = ROOT / "examples"
# Each example and the page that shows it.
SHOWN_ON = {
    "quickstart.py": README,
    "shard_tables.py": API,
    "train_ebc.py": API,
    "grid_tables.py": PLANNING,
    "shard_sequences.py": API,
    "train_pipeline.py": API,
}


def run_example(name: str, log_dir: Path) -> list[str]:
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
        [sys.executable, "-m", "torch.distributed.run", *launch, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=log_dir,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [
        ln for log in sorted(log_dir.rglob("stdout.log")) for ln in log.read_text().splitlines()
    ]


def shown_rank_lines(page: str, example: str) -> list[str]:
    """The rank lines ``page`` shows as ``example``'s output: after its code, before
    the next code block or section."""
    after = page.split(f"```python\n{(EXAMPLES / example).read_text()}```", 1)[1]
    end = re.search(r"^```python|^## ", after, flags=re.M)
    return re.findall(r"^    (rank \d .*)$", after[: end.start() if end else None], flags=re.M)


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> tuple[list[str], Path]:
    log_dir = tmp_path_factory.mktemp("quickstart")
    return run_example("quickstart.py", log_dir), log_dir


@pytest.mark.parametrize("page", sorted(PAGES), ids=str)
def test_every_python_block_is_an_example_file(page):
    files = {p.read_text() for p in EXAMPLES.glob("*.py")}
    for block in re.findall(r"```python\n(.*?)```", PAGES[page], flags=re.S):
        assert block in files, f"{page}: a Python block that is no file in examples/"


def test_every_example_is_shown_and_run():
    assert {p.name for p in EXAMPLES.glob("*.py")} == set(SHOWN_ON)
    for name, page in SHOWN_ON.items():
        assert f"```python\n{(EXAMPLES / name).read_text()}```" in page


def test_quickstart_output_matches_readme(quickstart):
    lines, _ = quickstart
    assert sorted(ln for ln in lines if ln.startswith("rank ")) == shown_rank_lines(
        README, "quickstart.py"
    )


def _quickstart_oracle() -> tuple[EmbeddingBagCollection, KeyedJaggedTensor]:
    """The unsharded module with the example's starting weights, and the global batch
    (rank 0's samples, then rank 1's)."""
    tables = [
        EmbeddingBagConfig(
            name="user", num_embeddings=1000, embedding_dim=16, feature_names=["uid"]
        ),
        EmbeddingBagConfig(
            name="item", num_embeddings=5000, embedding_dim=32, feature_names=["iid"]
        ),
    ]
    ebc = EmbeddingBagCollection(tables=tables)
    with torch.no_grad():
        for config in tables:
            init_shard(ebc.embedding_bags[config.name].weight, config, 0, 0, seed=0)
    batch = KeyedJaggedTensor(
        keys=["uid", "iid"],
        values=torch.tensor([0, 7, 1, 7, 4000, 12, 13, 4001, 12, 13]),
        lengths=torch.tensor([1, 1, 1, 1, 1, 2, 1, 2]),
    )
    return ebc, batch


def _rank_losses(ebc: EmbeddingBagCollection, batch: KeyedJaggedTensor) -> list[torch.Tensor]:
    pooled = ebc(batch).values()
    return [pooled[2 * r : 2 * r + 2].pow(2).sum() for r in range(2)]


def test_quickstart_against_unsharded_oracle(quickstart):
    """Forward, the fused SGD step on the global batch (loss averaged over ranks), the
    saved tables and the load under another plan, all against plain TorchRec."""
    lines, log_dir = quickstart
    printed = {
        (int(m[1]), "reloaded" in ln): float(m[2])
        for ln in lines
        if (m := re.match(r"rank (\d) .*loss ([0-9.]+)$", ln))
    }
    ebc, batch = _quickstart_oracle()
    losses = _rank_losses(ebc, batch)
    (sum(losses) / 2).backward()
    before = [float(x.detach()) for x in losses]
    with torch.no_grad():
        for bag in ebc.embedding_bags.values():
            bag.weight -= 0.5 * bag.weight.grad
        after = [float(x) for x in _rank_losses(ebc, batch)]
    for r in range(2):
        assert printed[(r, False)] == pytest.approx(before[r], abs=2e-6)
        assert printed[(r, True)] == pytest.approx(after[r], abs=2e-6)
    assert after[0] < before[0] / 2  # the step is large enough to tell the two apart

    checkpoint.export(log_dir / "runs" / "quickstart", log_dir / "saved.pt")
    saved = torch.load(log_dir / "saved.pt")
    for name, bag in ebc.embedding_bags.items():
        torch.testing.assert_close(saved[f"embedding_bags.{name}.weight"], bag.weight.detach())


def _pipeline_batch(step: int, rank: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """examples/train_pipeline.py's batch of ``rank`` at ``step``: dense features, the ids
    and bag lengths of uid and iid, labels."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    users = torch.randint(0, 1000, (8,), generator=g)
    item_counts = torch.randint(0, 4, (8,), generator=g)
    items = torch.randint(0, 5000, (int(item_counts.sum()),), generator=g)
    dense = torch.rand(8, 4, generator=g)
    return dense, [users, items, item_counts], (users < 500).float()


def _pipeline_oracle_losses(
    steps: int, dense_lr: float = 0.5, table_lr: float = 0.1
) -> dict[tuple[int, int], float]:
    """Each rank's loss at each step of the unsharded DLRM trained on the global batch
    (rank 0's samples, then rank 1's; the loss averaged over ranks): the dense layers by
    SGD, the tables by row-wise Adagrad written out here (a float per row, the mean of
    its squared gradient, eps 1e-8)."""
    tables = [
        EmbeddingBagConfig(
            name="user", num_embeddings=1000, embedding_dim=8, feature_names=["uid"]
        ),
        EmbeddingBagConfig(
            name="item", num_embeddings=5000, embedding_dim=8, feature_names=["iid"]
        ),
    ]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=tables, device="meta")
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=4,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
    )
    ebc.to_empty(device="cpu")
    with torch.no_grad():
        for config in tables:
            init_shard(ebc.embedding_bags[config.name].weight, config, 0, 0, seed=0)
    weights = [bag.weight for bag in ebc.embedding_bags.values()]
    dense = [p for p in dlrm.parameters() if all(p is not w for w in weights)]
    optimizer = torch.optim.SGD(dense, lr=dense_lr)
    row_states = [torch.zeros(len(w)) for w in weights]
    losses = {}
    for step in range(steps):
        dense0, (u0, i0, c0), labels0 = _pipeline_batch(step, 0)
        dense1, (u1, i1, c1), labels1 = _pipeline_batch(step, 1)
        features = KeyedJaggedTensor(
            keys=["uid", "iid"],
            values=torch.cat([u0, u1, i0, i1]),
            lengths=torch.cat([torch.ones(16, dtype=torch.long), c0, c1]),
        )
        logits = dlrm(torch.cat([dense0, dense1]), features).squeeze(-1)
        labels = torch.cat([labels0, labels1])
        per_rank = [
            F.binary_cross_entropy_with_logits(logits[8 * r : 8 * r + 8], labels[8 * r : 8 * r + 8])
            for r in range(2)
        ]
        losses.update({(r, step): loss.item() for r, loss in enumerate(per_rank)})
        optimizer.zero_grad()
        for weight in weights:
            weight.grad = None
        (sum(per_rank) / 2).backward()
        optimizer.step()
        with torch.no_grad():
            for weight, state in zip(weights, row_states):
                state += weight.grad.pow(2).mean(1)
                weight -= table_lr * weight.grad / (state.sqrt() + 1e-8)[:, None]
    return losses


def test_pipeline_example_output_matches_its_page_and_the_unsharded_dlrm(tmp_path):
    printed = sorted(
        ln for ln in run_example("train_pipeline.py", tmp_path) if ln.startswith("rank ")
    )
    assert printed == shown_rank_lines(API, "train_pipeline.py")
    losses = {
        (int(m[1]), int(m[2])): float(m[3])
        for ln in printed
        if (m := re.fullmatch(r"rank (\d) step (\d) loss ([0-9.]+)", ln))
    }
    oracle = _pipeline_oracle_losses(steps=4)
    assert len(losses) == 8 and losses.keys() == oracle.keys()
    for key, loss in losses.items():
        assert loss == pytest.approx(oracle[key], abs=2e-6), key
    # Both updates are large enough to tell apart: without the dense step every later
    # loss differs, without the tables' some later loss does.
    no_dense = _pipeline_oracle_losses(steps=4, dense_lr=0.0)
    assert all(abs(oracle[k] - no_dense[k]) > 1e-3 for k in oracle if k[1] > 0)
    no_tables = _pipeline_oracle_losses(steps=4, table_lr=0.0)
    assert max(abs(oracle[k] - no_tables[k]) for k in oracle) > 1e-4


def test_shard_tables_output_matches_docs(tmp_path):
    printed = sorted(
        ln for ln in run_example("shard_tables.py", tmp_path) if ln.startswith("rank ")
    )
    assert printed == shown_rank_lines(API, "shard_tables.py")


def test_grid_example_output_and_drawing_match_docs(tmp_path):
    printed = sorted(ln for ln in run_example("grid_tables.py", tmp_path) if ln.startswith("rank "))
    assert printed == shown_rank_lines(PLANNING, "grid_tables.py")
    assert sum("equals unsharded: True" in ln for ln in printed) == 4
    ads = EmbeddingBagConfig(name="ads", num_embeddings=10000, embedding_dim=64)
    plan = embshard.ShardingPlan(
        {"ads": embshard.grid([16, 48], [[0, 1], [1]], [[1000, 9000], [10000]])}
    )
    drawing = draw_table(plan.resolve([ads], 2)["ads"], 40)
    assert "\n".join(f"    {line}" for line in drawing) in PLANNING


def test_sequence_example_output_matches_readme_and_learns(tmp_path):
    printed = sorted(
        ln for ln in run_example("shard_sequences.py", tmp_path) if ln.startswith("rank ")
    )
    assert printed == shown_rank_lines(API, "shard_sequences.py")
    # Both steps equal the unsharded EmbeddingCollection's, and the first step's update
    # lowered every rank's loss.
    assert len(printed) == 4 and all(ln.endswith("same: True") for ln in printed)
    losses = [float(re.search(r"loss ([0-9.]+)", ln)[1]) for ln in printed]
    assert losses[1] < losses[0] / 2 and losses[3] < losses[2] / 2


def test_training_example_learns(tmp_path):
    steps = [ln for ln in run_example("train_ebc.py", tmp_path) if ln.startswith("step ")]
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
    (shown,) = re.findall(r"```yaml\n(.*?)```", PAGES[Path("docs/planning.md")], flags=re.S)
    assert embshard.ShardingPlan.from_yaml(shown) == plan


def transcripts(page: str) -> list[tuple[str, list[str]]]:
    """Each `$ embshard plan ...` shown on a page, with the lines shown under it."""
    found = []
    for m in re.finditer(r"^    \$ (embshard plan .*)\n((?:    .*\n)*)", page, flags=re.M):
        found.append((m[1], [ln[4:] for ln in m[2].splitlines()]))
    return found


@pytest.mark.parametrize(
    "command, shown",
    [t for page in PAGES.values() for t in transcripts(page)],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_plan_transcripts_are_the_commands_output(command, shown):
    """The shown lines appear in the output, in order (a page may leave lines out)."""
    result = CliRunner().invoke(cli, shlex.split(command)[1:])
    assert result.exit_code == 0, result.output
    output = iter(result.output.splitlines())
    for line in shown:
        assert any(line == out for out in output), f"not in the output, or out of order: {line!r}"


def test_plan_transcripts_are_found():
    assert len([t for page in PAGES.values() for t in transcripts(page)]) == 3


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", sorted(PAGES), ids=str)
def test_links_and_named_files_exist(page):
    text = PAGES[page]
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", text):
        if target.startswith("http"):
            continue
        path = (ROOT / page).parent / target if target else ROOT / page
        assert path.exists(), f"{page}: link to missing {target}"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", path.read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, (
                f"{page}: no heading #{anchor} in {target}"
            )
    for named in re.findall(
        r"\b((?:configs|examples|tools|docs|tests|embshard)/[\w./]+\.\w+)", text
    ):
        assert (ROOT / named).exists(), f"{page} names {named}, which does not exist"


def test_readme_make_targets_do_what_it_says():
    makefile = (ROOT / "Makefile").read_text()
    recipes = dict(re.findall(r"^(\w+): install\n\t(.*)$", makefile, flags=re.M))
    assert "make demo" in README and "make test" in README
    assert recipes["demo"] == "$(VENV)/bin/embshard train configs/small.yaml --nproc 2"
    assert ".venv/bin/embshard train configs/small.yaml --nproc 2" in README
    assert recipes["test"] == "$(VENV)/bin/python -m pytest -q"


def synopsis(page: str) -> list[tuple[list[str], set[str]]]:
    """Each `embshard SUB ...` usage line on a page: its subcommand and the options it shows."""
    found = []
    for line in re.findall(r"^    (embshard [a-z].*)$", page, flags=re.M):
        words = line.split("#")[0].split()[1:]
        sub = [w for w in words[:2] if re.fullmatch(r"[a-z]+", w)]
        found.append((sub, set(re.findall(r"--[a-z][a-z-]*", line.split("#")[0]))))
    return found


@pytest.mark.parametrize("page", sorted(PAGES), ids=str)
def test_cli_synopses_name_real_options(page):
    for sub, options in synopsis(PAGES[page]):
        result = CliRunner().invoke(cli, [*sub, "--help"])
        assert result.exit_code == 0, f"embshard {' '.join(sub)}: {result.output}"
        for option in options:
            assert option in result.output, f"{page}: embshard {' '.join(sub)} has no {option}"
