"""`torch.cuda.OutOfMemoryError` as PyTorch 1.13+ defines it: a RuntimeError subclass."""


class OutOfMemoryError(RuntimeError):
    pass
