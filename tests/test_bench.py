"""The benchmark runs, checks both libraries agree, and reports every figure."""

from __future__ import annotations

import json

from embshard.bench import main


def test_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    main(["--world-sizes", "2", "--workloads", "a", "--plans", "mixed", "--steps", "2",
          "--warmup", "1", "--json", str(out)])  # fmt: skip
    data = json.loads(out.read_text())
    assert data["gather_gbps"] > 0
    (record,) = data["results"]
    assert record["outputs_equal"]
    assert record["embshard"]["collectives_per_step"] == 4
    assert record["torchrec"]["collectives_per_step"] > 4
    for library in ("embshard", "torchrec"):
        figures = record[library]
        assert figures["p10_ms"] <= figures["median_ms"] <= figures["p90_ms"]
        assert figures["bytes_sent_per_rank"] > 0 and figures["samples_per_s"] > 0
    assert record["bare_tbe_ms"] > 0 and record["throughput_ratio"] > 0
    assert record["pipelined_median_ms"] > 0 and record["pipeline_gain"] > 0
