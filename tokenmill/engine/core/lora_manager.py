"""The served LoRA adapters: loaded by name on first use, installed into the model's
LoRALinear wrappers by integer id, and evicted least-recently-used past
--max-cpu-loras (never one a live request runs under).

vLLM keeps two tiers (--max-loras on the device, --max-cpu-loras in host memory);
on a CPU both are host memory, so here --max-cpu-loras bounds what stays loaded
and --max-loras bounds the distinct adapters of one batch (the scheduler's
admission check)."""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.loaders.lora_adapter import LoRAAdapter, LoRAAdapterError, load_peft_adapter
from tokenmill.lora_request import LoRARequest, UnknownLoRAError
from tokenmill.models.lora import LoRALinear, apply_lora

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 live_ids: Callable[[], set[int]], dtype: torch.dtype) -> None:
        self.model_config = model_config
        self.max_rank = config.max_lora_rank
        self.max_loaded = config.max_cpu_loras or config.max_loras
        self.live_ids = live_ids  # the adapter ids live requests run under
        self.dtype = dtype
        self.wrapped: list[tuple[int, str, LoRALinear]] = apply_lora(model)
        self.served: dict[str, LoRARequest] = {}  # name -> request (served, maybe not loaded)
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU, oldest first
        self._ids = itertools.count(1)
        # the runtime routes add and remove adapters from the server's threads
        self._lock = threading.RLock()
        for name, path in config.lora_modules:
            self.add(name, path)

    # ---- what is served ------------------------------------------------------------

    def add(self, name: str, path: str) -> LoRARequest:
        """Serve `path` as `name` (loaded and checked now, so that a bad adapter fails here)."""
        with self._lock:
            return self._add(name, path)

    def _add(self, name: str, path: str) -> LoRARequest:
        if name in self.served:
            raise LoRAAdapterError(f"LoRA adapter {name!r} is already loaded", "lora_name")
        req = LoRARequest(name, next(self._ids), str(path))
        self._load(req)
        self.served[name] = req
        return req

    def remove(self, name: str) -> None:
        with self._lock:
            self._remove(name)

    def _remove(self, name: str) -> None:
        req = self.served.get(name)
        if req is None:
            raise UnknownLoRAError(f"LoRA adapter {name!r} is not loaded")
        if req.lora_int_id in self.live_ids():
            raise LoRAAdapterError(f"LoRA adapter {name!r} has requests running", "lora_name")
        del self.served[name]
        self._unload(req.lora_int_id)

    def lookup(self, name: str) -> LoRARequest | None:
        return self.served.get(name)

    # ---- a request's adapter -----------------------------------------------------------

    def acquire(self, req: LoRARequest) -> LoRARequest:
        """The adapter a new request runs under, loaded and most recently used. A
        LoRARequest not served yet (the offline LLM's way) is served under its name."""
        with self._lock:
            return self._acquire(req)

    def _acquire(self, req: LoRARequest) -> LoRARequest:
        known = self.served.get(req.lora_name)
        if known is None:
            if not req.lora_path:
                raise UnknownLoRAError(f"LoRA adapter {req.lora_name!r} is not loaded")
            if any(r.lora_int_id == req.lora_int_id for r in self.served.values()):
                raise LoRAAdapterError(f"lora_int_id {req.lora_int_id} is already used by "
                                       "another adapter", "lora_request")
            self._load(req)
            self.served[req.lora_name] = req
            return req
        if req.lora_path and req.lora_path != known.lora_path:
            raise LoRAAdapterError(f"LoRA adapter {req.lora_name!r} is already served from "
                                   f"{known.lora_path!r}", "lora_request")
        if known.lora_int_id not in self.loaded:
            self._load(known)  # evicted earlier: back from disk
        self.loaded.move_to_end(known.lora_int_id)
        return known

    def _load(self, req: LoRARequest) -> None:
        adapter = load_peft_adapter(req.lora_name, req.lora_path, self.model_config,
                                    self.max_rank)
        self._evict_for_one()
        for layer, _, mod in self.wrapped:
            pairs = {m: tuple(t.to(self.dtype) for t in adapter.weights[(layer, m)])
                     for m in mod.names if (layer, m) in adapter.weights}
            mod.install(req.lora_int_id, pairs)  # type: ignore[arg-type]
        self.loaded[req.lora_int_id] = adapter
        logger.info("LoRA adapter %r loaded (id %d, rank %d, %s)", req.lora_name,
                    req.lora_int_id, adapter.rank, ", ".join(adapter.target_modules))

    def _evict_for_one(self) -> None:
        live = self.live_ids()
        while len(self.loaded) >= self.max_loaded:
            idle = next((i for i in self.loaded if i not in live), None)
            if idle is None:
                raise LoRAAdapterError(f"every loaded LoRA adapter ({len(self.loaded)}, "
                                       "--max-cpu-loras) has requests running", "model")
            self._unload(idle)

    def _unload(self, lora_id: int) -> None:
        if self.loaded.pop(lora_id, None) is not None:
            for _, _, mod in self.wrapped:
                mod.remove(lora_id)


def run_under(seqs: list, lora: LoRARequest | None) -> None:
    for seq in seqs:
        seq.lora_request = lora


def resolve_lora(manager: LoRAManager | None, req: object, params: object
                 ) -> LoRARequest | None:
    """A new request's adapter, checked (RequestError naming `lora_request`/`model`)."""
    from tokenmill.engine.core.validation import RequestError

    if req is None:
        return None
    if not isinstance(req, LoRARequest):
        raise RequestError(f"lora_request must be a LoRARequest, got {type(req).__name__}",
                           "lora_request")
    if manager is None:
        raise RequestError(f"LoRA adapter {req.lora_name!r} asked for, but LoRA is off: "
                           "start the engine with --enable-lora", "lora_request")
    if getattr(params, "structured_outputs", None) is not None:
        raise RequestError("structured output with a LoRA adapter is not supported yet",
                           "structured_outputs")
    try:
        return manager.acquire(req)
    except UnknownLoRAError as e:
        raise RequestError(str(e), "model") from e
    except LoRAAdapterError as e:
        raise RequestError(str(e), e.param) from e
