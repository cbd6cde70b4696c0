"""Write a small file in the Criteo Kaggle TSV format, for tests and demos.

    python tools/make_criteo_sample.py OUT.tsv --lines 20000 --seed 0

Each line: a 0/1 label, 13 integer columns (some empty, a few negative) and 26
categorical columns of 8 hex digits (some empty). Category values are drawn from a
power law per column, and the label from a hidden logistic model of a few of them,
so a model trained on the file can do better than chance.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

DENSE, CATEGORICAL = 13, 26


def sample_lines(lines: int, seed: int) -> list[str]:
    """``lines`` lines drawn with ``seed``; the vocabulary and the hidden model are the
    same for every seed, so a file written with another seed is held-out data."""
    hidden = random.Random(0)
    vocab = [
        [hidden.getrandbits(32) for _ in range(hidden.choice([50, 500, 5000]))]
        for _ in range(CATEGORICAL)
    ]
    weight = {(c, v): hidden.gauss(0, 1.5) for c in range(0, CATEGORICAL, 3) for v in vocab[c]}
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        dense = [
            ""
            if rng.random() < 0.1
            else str(int(rng.paretovariate(1.2)) - (rng.random() < 0.02) * 3)
            for _ in range(DENSE)
        ]
        cats, logit = [], -1.0
        for c in range(CATEGORICAL):
            if rng.random() < 0.05:
                cats.append("")
                continue
            value = vocab[c][min(int(rng.paretovariate(1.0)) - 1, len(vocab[c]) - 1)]
            logit += weight.get((c, value), 0.0)
            cats.append(f"{value:08x}")
        label = int(rng.random() < 1 / (1 + 2.718281828**-logit))
        out.append("\t".join([str(label), *dense, *cats]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--lines", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(sample_lines(args.lines, args.seed)) + "\n")


if __name__ == "__main__":
    main()
