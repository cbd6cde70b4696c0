"""Serving: trained tables quantized (int8, int4, fp16 rows with FBGEMM's row-wise scale
and bias) and looked up in FBGEMM's inference TBE, forward only, on one host; the
model exported with ``torch.export`` for a predictor that does not import embshard;
or sharded over ranks as in training, forward only (``shard_quantized``). Dynamic tables
are served with their id maps made lookup-only (``ServedIdMap``), TorchRec's
managed-collision collections with their modules remapping in eval mode.
``from embshard import serving`` gives the calls below."""

from embshard.serving.collection import (
    QuantizedEmbeddingBagCollection,
    QuantizedEmbeddingCollection,
)
from embshard.serving.export import Manifest, export_model
from embshard.serving.id_maps import ServedIdMap
from embshard.serving.model import from_checkpoint, quantize_model
from embshard.serving.precision import Precision
from embshard.serving.sharded import ServedShards, quantize_sharded, shard_quantized

__all__ = [
    "Manifest",
    "Precision",
    "QuantizedEmbeddingBagCollection",
    "QuantizedEmbeddingCollection",
    "ServedIdMap",
    "ServedShards",
    "export_model",
    "from_checkpoint",
    "quantize_model",
    "quantize_sharded",
    "shard_quantized",
]
