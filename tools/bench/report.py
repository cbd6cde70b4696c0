"""The bench's report: a line a cell, and the samples/s plot."""

from __future__ import annotations


def summary_line(r: dict) -> str:
    head = f"W={r['world_size']} {r['workload']} {r['plan']:<12} {r['comm_precision']} {r['ids']}"
    if "skipped" in r:
        return f"{head} skipped: {r['skipped']}"
    if not r["outputs_equal"]:
        return f"{head} outputs differ by {r['max_difference']:.2e}: not timed"
    ours, theirs = r["embshard"], r["torchrec"]
    return (
        f"{head} embshard {ours['median_ms']:7.2f} ms [{ours['p10_ms']:.2f}-{ours['p90_ms']:.2f}] "
        f"{ours['collectives_per_step']} coll {ours['bytes_sent_per_rank'] / 2**20:6.2f} MiB "
        f"{ours['ops_per_step']} ops | "
        f"torchrec {theirs['median_ms']:7.2f} ms [{theirs['p10_ms']:.2f}-{theirs['p90_ms']:.2f}] "
        f"{theirs['collectives_per_step']} coll {theirs['bytes_sent_per_rank'] / 2**20:6.2f} MiB "
        f"{theirs['ops_per_step']} ops | "
        f"ratio {r['throughput_ratio']:.2f}x | bare TBE {r['bare_tbe_ms']:.2f} ms "
        f"(x{r['overhead_vs_bare_tbe']:.2f}) + collectives alone "
        f"{r['collectives_alone_ms']:.2f} ms (x{r['step_over_floor']:.2f}) | "
        f"pipelined {r['pipelined_median_ms']:.2f} ms (x{r['pipeline_gain']:.2f}) | repeated ids "
        + " ".join(f"{f:.2f}" for f in r["duplicate_id_fraction_per_rank"])
    )


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in records if r.get("outputs_equal")]
    labels = [f"{r['workload']}/{r['plan']}\nW={r['world_size']}" for r in timed]
    x = range(len(timed))
    figure, axes = plt.subplots(figsize=(max(8, len(timed) * 0.9), 4.5))
    axes.bar(
        [i - 0.2 for i in x], [r["embshard"]["samples_per_s"] for r in timed], 0.4, label="embshard"
    )
    axes.bar(
        [i + 0.2 for i in x],
        [r["torchrec"]["samples_per_s"] for r in timed],
        0.4,
        label="TorchRec DMP",
    )
    axes.set_xticks(list(x), labels, fontsize=7)
    axes.set_ylabel("training samples/s (all ranks)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
