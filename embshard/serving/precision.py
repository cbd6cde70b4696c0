"""The precisions a served table's rows are stored in, as FBGEMM's inference TBE reads
them: each knows its FBGEMM type, the dims it can pack and how it quantizes a row."""

from __future__ import annotations

import enum

import torch
from fbgemm_gpu.split_embedding_configs import SparseType

from embshard.errors import ConfigError

# FBGEMM stores an integer row's scale and bias as two fp16 after its packed values.
SCALE_BIAS_BYTES = 4
# Where FBGEMM's inference kernels run every precision here.
DEVICES = ("cpu", "cuda")


class Precision(enum.Enum):
    """A table's stored precision: ``fp16`` rows, or ``int8``/``int4`` values with a
    row-wise scale and bias (``x ~ scale * q + bias``)."""

    FP16 = "fp16"
    INT8 = "int8"
    INT4 = "int4"

    @classmethod
    def parse(cls, name: str | Precision) -> Precision:
        """The precision named ``name`` (``int8``, ``int4``, ``fp16``); a one-line error
        for any other."""
        if isinstance(name, Precision):
            return name
        try:
            return cls(str(name).lower())
        except ValueError:
            known = ", ".join(p.value for p in cls)
            raise ConfigError(
                f"unknown precision {name!r}: FBGEMM's inference TBE serves {known}"
            ) from None

    @property
    def sparse_type(self) -> SparseType:
        return SparseType(self.value)

    @property
    def bits(self) -> int:
        return self.sparse_type.bit_rate()

    @property
    def integer(self) -> bool:
        """Whether rows carry a scale and bias (fp16 rows are plain halves)."""
        return not self.sparse_type.is_float()

    def check_dim(self, table: str, dim: int) -> None:
        """A one-line error when ``dim`` values do not fill whole bytes at this precision."""
        per_byte = 8 // self.bits
        if self.integer and dim % per_byte:
            raise ConfigError(
                f"table {table!r}: embedding_dim {dim} cannot be packed as {self.value} "
                f"({per_byte} values a byte): it must be a multiple of {per_byte}"
            )

    def check_device(self, device: torch.device) -> None:
        """A one-line error where FBGEMM's inference TBE cannot run this precision."""
        if device.type not in DEVICES:
            raise ConfigError(
                f"{self.value} tables on {device.type}: FBGEMM's inference TBE runs them on "
                f"{' and '.join(DEVICES)} only"
            )
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"{self.value} tables on cuda: torch sees no CUDA device")

    def row_bytes(self, dim: int) -> int:
        """Bytes one row of ``dim`` takes, scale and bias included."""
        return dim * self.bits // 8 + (SCALE_BIAS_BYTES if self.integer else 0)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``weight``'s rows as FBGEMM's inference TBE stores them: packed values (uint8)
        and, for integer precisions, each row's scale and bias (uint8 view of two fp16)."""
        weight = weight.detach()
        if not self.integer:
            return weight.to(torch.float16).contiguous().view(torch.uint8), None
        fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(
            weight.float().contiguous(), self.bits
        )
        return fused[:, :-SCALE_BIAS_BYTES], fused[:, -SCALE_BIAS_BYTES:]
