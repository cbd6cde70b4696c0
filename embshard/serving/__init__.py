"""Serving: trained tables quantized (int8, int4, fp16 rows with FBGEMM's row-wise scale
and bias) and looked up in FBGEMM's inference TBE, forward only, on one host; the
model exported with ``torch.export`` for a predictor that does not import embshard."""
