"""Runs inside vLLM's own venv (not tokenmill's): W1 offline through `vllm.LLM`.

    VLLM_PYTHON vllm_offline_driver.py MODEL_DIR REQUESTS.json

REQUESTS.json is a list of [prompt_token_ids, max_tokens]. Greedy,
ignore_eos, one warm-up request first; the timed `generate` covers all
requests. Prints one JSON line: output_tokens, elapsed_s, startup_s. The
`__main__` guard matters: vLLM spawns its engine process.
"""

import json
import sys
import time


def main() -> None:
    model_dir, requests_path = sys.argv[1], sys.argv[2]
    with open(requests_path) as f:
        requests = json.load(f)
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=4096, seed=0)
    llm.generate([TokensPrompt(prompt_token_ids=requests[0][0][:16])],
                 SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    startup_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for _, m in requests]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed_s = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"output_tokens": n_out, "elapsed_s": elapsed_s,
                      "startup_s": startup_s}), flush=True)


if __name__ == "__main__":
    main()
