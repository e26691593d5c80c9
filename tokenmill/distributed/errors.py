"""The tensor-parallel failure, importable without torch (the front end catches it)."""


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group died or a collective failed: the group
    cannot be trusted any more, so the engine stops rather than retrying."""
