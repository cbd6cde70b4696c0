"""One step's data path, without tables: the routes (where each feature's ids go and
where their pooled rows come back), the batch checks, the input distribution (counts
exchange, ids all-to-all) and the output distribution (pooled all-to-all, column
placement), with their scratch buffers. Below storage and the modules."""
