"""The oracle: the unsharded TorchRec module fed the global batch, against which the
tests and ``embshard simulate --check`` hold the sharded one."""
