"""Double-buffered host staging for a step's metadata, and the event that guards
each buffer's reuse.

A step's host ints (input ids, positions, slot mapping, sequence lengths, block
tables) go to the device in one copy from a staging buffer. On CUDA the buffer
is pinned and the copy is `non_blocking`: it runs when the stream reaches it, so
the host must not write that buffer again until then. With async scheduling the
host writes step N+1's metadata while step N is still queued, so there are two
buffers, used in turn, and an event recorded after each buffer's copy; writing
a buffer first waits on its event (in practice long done: it was recorded two
steps ago). On a CPU the same class works over plain tensors: the "copy"
clones out of the buffer at once, so its event is always complete.
"""

from __future__ import annotations

import torch


class _DoneEvent:
    """A CPU step's copy is over when `upload` returns: nothing to wait for."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _event(device: torch.device):
    return torch.cuda.Event() if device.type == "cuda" else _DoneEvent()


class HostStaging:
    """Two int64 host buffers of at least `numel` elements, used in turn.

    `buf = staging.acquire(n)` (host): the next buffer, once its last copy is
    done, as a view of n elements to write; `staging.upload(buf)` (the thread
    that issues device work): its device copy, with the buffer's event recorded
    after it. Buffers grow when a step needs more."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self._buffers = [self._new(max(numel, 1)) for _ in range(2)]
        self._events = [_event(device), _event(device)]
        self._next = 0
        self._owner: dict[int, int] = {}  # data_ptr of an acquired view -> buffer index

    def _new(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=torch.int64, pin_memory=self._pin)

    def acquire(self, numel: int) -> torch.Tensor:
        i = self._next
        self._next = 1 - i
        self._events[i].synchronize()  # its previous copy has left the buffer
        if self._buffers[i].numel() < numel:
            self._buffers[i] = self._new(max(numel, 2 * self._buffers[i].numel()))
        view = self._buffers[i][:numel]
        self._owner[view.data_ptr()] = i
        return view

    def write(self, values: list[int]) -> torch.Tensor:
        """`values` on the host, for `upload`: in the next buffer on CUDA; on a CPU a
        tensor of their own (nothing to copy to a device, nothing to guard: at batch 1
        a step's weights sweep the caches, and each tiny op after costs ~30 us)."""
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=torch.int64)
        view = self.acquire(len(values))
        view.copy_(torch.tensor(values, dtype=torch.int64))
        return view

    def upload(self, view: torch.Tensor) -> torch.Tensor:
        """The device copy of an acquired view (its buffer may be written again once
        the copy has run: the event says when), or on a CPU `write`'s tensor itself."""
        i = self._owner.pop(view.data_ptr(), None)
        if self.device.type != "cuda":
            return view if i is None else view.clone()
        dev = view.to(self.device, non_blocking=True)
        self._events[i].record()
        return dev


class HostCopy:
    """A device tensor's copy to the host, queued now and read later: on CUDA into
    pinned memory behind an event, so that the thread waiting for it waits for this
    copy only, not for work queued on the stream after it (async scheduling's
    helper reads step N's tokens while step N+1 is queued). On a CPU: the tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event = _event(tensor.device)
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
        else:
            self._host = tensor
        self._event.record()

    def result(self) -> torch.Tensor:
        self._event.synchronize()
        return self._host
