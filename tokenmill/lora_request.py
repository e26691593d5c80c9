"""vLLM's LoRARequest: which adapter a request runs under. Plain Python."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: the adapter's served name (a request's `model`); lora_int_id: a
    positive id unique per adapter (0 is the base model); lora_path: the PEFT
    directory (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (0 is the base model), "
                             f"got {self.lora_int_id} for adapter {self.lora_name!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


class UnknownLoRAError(LookupError):
    """A request names an adapter that is not served (a 404)."""
