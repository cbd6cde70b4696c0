"""Benchmark embshard against TorchRec's DistributedModelParallel (the work is the
``bench`` package beside this script; ``embshard bench`` runs the same from a source
checkout, with the same options).

.venv/bin/python tools/bench.py --world-sizes 2 4 --workloads a b c --json bench.json
"""

from bench.command import bench

if __name__ == "__main__":
    bench(prog_name="tools/bench.py")
