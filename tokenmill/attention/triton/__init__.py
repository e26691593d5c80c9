"""The triton attention backend (kernels imported on first use; see backend.py)."""

from tokenmill.attention.triton.backend import TritonBackend

__all__ = ["TritonBackend"]
