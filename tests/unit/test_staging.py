"""The double-buffered host staging of a step's ints (engine/staging.py), on CPU."""

from __future__ import annotations

import torch

from tokenmill.engine.runner.staging import HostStaging


def test_buffers_alternate_and_a_cpu_upload_is_a_copy():
    staging = HostStaging(8, torch.device("cpu"))
    a = staging.acquire(4)
    a.copy_(torch.arange(4))
    b = staging.acquire(4)
    assert a.data_ptr() != b.data_ptr()  # step N+1 writes the other buffer
    b.fill_(7)
    dev_a = staging.upload(a)
    a.fill_(-1)  # the host may write the buffer again at once: the upload copied it
    assert dev_a.tolist() == [0, 1, 2, 3]
    assert staging.upload(b).tolist() == [7] * 4
    assert staging.acquire(2).data_ptr() == a.data_ptr()  # back to the first


def test_a_step_larger_than_the_buffer_grows_it():
    staging = HostStaging(4, torch.device("cpu"))
    big = staging.acquire(100)
    big.copy_(torch.arange(100))
    assert staging.upload(big).tolist() == list(range(100))


def test_written_steps_keep_their_own_values_on_cpu():
    # async scheduling writes step N+1 while step N's ints are still in use: on a CPU
    # each written step is a tensor of its own, uploaded as it is
    staging = HostStaging(8, torch.device("cpu"))
    first = staging.write([1, 2, 3])
    second = staging.write([4, 5, 6, 7])
    dev_first = staging.upload(first)
    assert dev_first.dtype == torch.int64 and dev_first.tolist() == [1, 2, 3]
    assert staging.upload(second).tolist() == [4, 5, 6, 7]
    assert dev_first.data_ptr() != second.data_ptr()
