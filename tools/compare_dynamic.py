"""A config with dynamic tables against its static twin: the same model, data and memory,
each dynamic table made static (its raw ids hashed onto its rows, where ids live at
the same time collide) with as many more rows as its id map's bytes would hold.

    PYTHONPATH=$PWD .venv/bin/python tools/compare_dynamic.py configs/dynamic.yaml \\
        [--nproc 2] [--steps N] [--json out.json]

Trains both with ``embshard train CONFIG --nproc N``, one after the other, and prints
each evaluation's AUC and loss side by side, then the dynamic tables' id counts at the
end (admitted, evicted, overflowing, live).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import yaml

from embshard.app.config import load_config
from embshard.app.planning import topology_for
from embshard.planner.cost import CostModel
from embshard.planner.tables import planned_tables

COMMAND = [sys.executable, "-c", "from embshard.app.cli import main; main()", "train"]


def twin(config: dict, path: Path) -> dict:
    """``config`` (read from ``path``) with every table static, a dynamic table given
    the rows that its weights, optimizer state and id map take together (the planner's
    bytes), and the same ids: drifting ids keep each dynamic table's count of live ids
    (Criteo's raw values are the same whatever the rows)."""
    parsed = load_config(path, check_files=False)
    model = CostModel(topology_for(parsed, 1), parsed.batch_size, parsed.sparse_optimizer.type)
    drift = parsed.data.drift
    live = dict(drift.live or {}) if drift is not None else {}
    planned = planned_tables(parsed.tables, dynamic=parsed.id_maps())
    tables = []
    for raw, table in zip(config["tables"], planned, strict=True):
        static = {k: v for k, v in raw.items() if k != "dynamic"}
        if table.dynamic:
            rows, dim = table.num_embeddings, table.embedding_dim
            static_row = model.memory(replace(table, map_bytes=0), 1, dim)
            static["num_embeddings"] = model.memory(table, rows, dim) // static_row
            if drift is not None:
                live.setdefault(table.name, max(1, round(drift.live_per_row * rows)))
        tables.append(static)
    if drift is None:
        return config | {"tables": tables}
    data = config["data"] | {"drift": config["data"]["drift"] | {"live": live}}
    return config | {"tables": tables, "data": data}


def train(config: dict, folder: Path, name: str, nproc: int) -> tuple[list[dict], dict]:
    """One run of ``config`` in ``folder``: its evaluations and its summary."""
    metrics = folder / f"{name}.jsonl"
    config = config | {"logging": {"metrics": str(metrics), "every": 20, "progress": False}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [*COMMAND, str(path), "--nproc", str(nproc)], capture_output=True, text=True
    )
    if done.returncode:
        sys.exit(f"{name} run failed:\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout.rsplit("embshard: done ", 1)[1].splitlines()[0])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in records if "eval_auc" in r], summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, help="in place of the config's")
    parser.add_argument("--json", help="write both runs' evaluations and summaries here")
    args = parser.parse_args()
    config_path = Path(args.config).resolve()
    config = yaml.safe_load(config_path.read_text())
    if args.steps:
        config["steps"] = args.steps
    if not any("dynamic" in t for t in config["tables"]):
        sys.exit(f"{args.config} has no dynamic table")
    if config.get("data", {}).get("type", "synthetic") == "synthetic" and not config.get(
        "data", {}
    ).get("drift"):
        sys.exit(f"{args.config}: synthetic ids without drift fit the tables: nothing collides")
    data = config.get("data", {})
    for key in ("path", "eval_path"):  # read from the config's folder, as train reads them
        if data.get(key):
            data[key] = str(config_path.parent / data[key])
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            name: train(c, Path(tmp), name, args.nproc)
            for name, c in (("dynamic", config), ("static", twin(config, config_path)))
        }
    (dynamic, end), (static, _) = runs["dynamic"], runs["static"]
    print(f"{args.config}, {args.nproc} ranks: eval AUC (loss), dynamic tables vs hashed static")
    for d, s in zip(dynamic, static, strict=True):
        gain = d["eval_auc"] - s["eval_auc"]
        print(
            f"  step {d['step']:>6}: {d['eval_auc']:.4f} ({d['eval_loss']:.4f})  "
            f"{s['eval_auc']:.4f} ({s['eval_loss']:.4f})  {gain:+.4f}"
        )
    for table, counts in end.get("dynamic", {}).items():
        print(f"  {table}: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
