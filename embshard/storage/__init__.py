"""Where a rank's shards live: one FBGEMM TBE holding every local shard and its fused
optimizer, the seeded initialization, the copies of data-parallel tables and hot rows,
and the ``LocalShardsWrapper`` views that expose each table as a DTensor."""
