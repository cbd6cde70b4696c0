"""The modules users hold: the sharded EmbeddingBagCollection and EmbeddingCollection
(stage by stage: input distribution, lookup, output distribution), ``shard()``,
``shard_model()`` for whole models, and the training pipeline."""
