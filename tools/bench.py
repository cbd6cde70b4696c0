"""Benchmark embshard against TorchRec's DistributedModelParallel: `embshard bench`
(embshard/app/cli.py; the work is embshard/app/bench.py's), with the same options.

.venv/bin/python tools/bench.py --world-sizes 2 4 --workloads a b c --json bench.json
"""

from embshard.app.cli import bench

if __name__ == "__main__":
    bench(prog_name="tools/bench.py")
