"""The accuracy gate on KL divergence (issue 57), measured as llama.cpp measures a
quantized file: `llama-perplexity --kl-divergence`'s positions, its KLD definition,
bootstrap intervals over chunks, and llama.cpp's own figures on the same file beside
tokenmill's.

    chunks.py        which positions llama-perplexity scores (n_ctx, BOS, second half)
    kld.py           per-position KLD / NLL / top-1 and llama.cpp's log-prob encoding
    bootstrap.py     95% intervals by resampling chunks
    llama_files.py   llama-perplexity's --kl-divergence-base file (tokens + log-probs)
    f32_gguf.py      FILE-f32.gguf: every tensor dequantized to F32 (the reference)
    llama_runs.py    runs llama-perplexity and parses its printed statistics
    tokenmill_runs.py  tokenmill's per-position log-probs through the real engine
    gate.py          the table, the rule, the JSON (benchmarks/kld_gate.py runs it)
"""
