"""The paged KV cache: block manager and prefix cache (torch-free), the KV budget
and the pool allocation (the parts that touch tensors)."""
