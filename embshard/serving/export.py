"""A serving model exported with ``torch.export`` into a folder a predictor loads with
torch and fbgemm_gpu alone (``import fbgemm_gpu`` registers the lookup ops):

    model.pt2       the exported program: (dense, ids, lengths) -> logits
    serving.json    what its inputs are (feature order, dense width), precision, bytes,
                    each dynamic table's id map (live ids, bytes)

The program takes plain tensors, not a KeyedJaggedTensor, so that loading it needs no
TorchRec: ``dense`` ``[batch, dense_in]`` float32, ``ids`` int64, ``lengths``
``[features * batch]`` int64, feature by feature in ``serving.json``'s order (a dynamic
table's features take raw ids, which the program maps to rows). The batch size and the
number of ids are dynamic.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embshard.serving.collection import QuantizedEmbeddingBagCollection

PROGRAM = "model.pt2"
MANIFEST = "serving.json"
FORMAT = 1


@dataclass(frozen=True)
class Manifest:
    """What a served model takes and holds, written beside the program."""

    features: list[str]
    dense_in: int
    precision: str
    table_bytes: int  # the quantized tables, scale and bias included
    float32_bytes: int  # the same tables in float32
    extra: dict[str, Any]  # what the exporter adds (the training config, the step)
    format: int = FORMAT
    # A sharded artifact's ``world_size`` and ``plan`` (YAML form); None: one host.
    sharded: dict[str, Any] | None = None
    # Each dynamic table's served id map: ``live`` ids, the map's ``bytes``.
    id_maps: dict[str, dict[str, int]] | None = None

    def write(self, out: str | Path) -> None:
        (Path(out) / MANIFEST).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, artifact: str | Path) -> Manifest:
        return cls(**json.loads((Path(artifact) / MANIFEST).read_text()))


class TensorInputs(nn.Module):
    """``model`` called on plain tensors: the KeyedJaggedTensor is built in the traced
    forward, so the exported program's inputs are tensors only."""

    def __init__(self, model: nn.Module, features: list[str]) -> None:
        super().__init__()
        self.model, self.features = model, features

    def forward(
        self, dense: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        sparse = KeyedJaggedTensor(keys=self.features, values=ids, lengths=lengths)
        return self.model(dense, sparse)


def serving_collection(model: nn.Module) -> QuantizedEmbeddingBagCollection:
    """The model's one quantized collection (what the exported inputs feed)."""
    found = [m for m in model.modules() if isinstance(m, QuantizedEmbeddingBagCollection)]
    if len(found) != 1:
        raise ValueError(
            f"a served model needs one quantized collection, this one has {len(found)}"
        )
    return found[0]


def example_inputs(features: int, dense_in: int, batch: int = 4) -> tuple[torch.Tensor, ...]:
    """Inputs of the exported program's form: one id of row 0 per bag."""
    return (
        torch.zeros(batch, dense_in),
        torch.zeros(features * batch, dtype=torch.long),
        torch.ones(features * batch, dtype=torch.long),
    )


def export_model(
    model: nn.Module, out: str | Path, dense_in: int, extra: Mapping[str, Any] | None = None
) -> Manifest:
    """Export the serving ``model`` (``model(dense, kjt) -> logits``) into the folder
    ``out`` (made if missing) and return what ``serving.json`` holds."""
    ebc = serving_collection(model)
    wrapped = TensorInputs(model, ebc.features).eval()
    batch = torch.export.Dim("batch", min=1)
    # Size-oblivious tracing: else the batch size derived from ``lengths`` is assumed to
    # be above 1 and the program refuses a batch of one sample. Without gradients: a
    # forward that turns them off itself (TorchRec's MCH remap) then records no switch,
    # which the saved program could not be loaded with.
    with torch.fx.experimental._config.patch(backed_size_oblivious=True), torch.no_grad():
        program = torch.export.export(
            wrapped,
            example_inputs(len(ebc.features), dense_in),
            dynamic_shapes={
                "dense": {0: batch},
                "ids": {0: torch.export.Dim("ids", min=0)},
                "lengths": {0: len(ebc.features) * batch},
            },
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, out / PROGRAM)
    manifest = Manifest(
        features=ebc.features,
        dense_in=dense_in,
        precision=ebc.precision.value,
        table_bytes=ebc.table_bytes(),
        float32_bytes=float32_bytes(ebc.embedding_bag_configs()),
        extra=dict(extra or {}),
        id_maps={
            name: {"live": m.live, "bytes": m.map_bytes()} for name, m in ebc.lookup.id_maps.items()
        }
        or None,
    )
    manifest.write(out)
    return manifest


def float32_bytes(tables: Iterable[BaseEmbeddingConfig]) -> int:
    """Bytes ``tables`` take in float32."""
    return sum(t.num_embeddings * t.embedding_dim * 4 for t in tables)
