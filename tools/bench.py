"""Benchmark embshard against TorchRec's DistributedModelParallel: see embshard/bench.py.

.venv/bin/python tools/bench.py --world-sizes 2 4 --workloads a b c --json bench.json
"""

from embshard.bench import main

if __name__ == "__main__":
    main(prog="tools/bench.py")
