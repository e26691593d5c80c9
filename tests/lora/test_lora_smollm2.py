"""A peft adapter on the embedded SmolLM2-135M's shapes, served over its quantized GGUF
linears (quant/fused_mlp.py's fused silu-mul down_proj included): the adapter changes
the output, and a prompt's tokens are the same alone and in a batch with the base."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")


def test_adapter_on_smollm2_alone_and_mixed_with_the_base(tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                   num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, tie_word_embeddings=True)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), peft.LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                             "gate_proj", "up_proj", "down_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.05)
    model.save_pretrained(tmp_path)
    llm = LLM("smollm2-135m", enable_lora=True, max_loras=2)
    sp = SamplingParams(temperature=0, max_tokens=12)
    lora = LoRARequest("x", 1, str(tmp_path))
    prompt = "The capital of France is"
    mixed = llm.generate([prompt, prompt], sp, use_tqdm=False, lora_request=[None, lora])
    alone = llm.generate([prompt], sp, use_tqdm=False, lora_request=lora)[0]
    base = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert mixed[0].outputs[0].token_ids == base.outputs[0].token_ids
    assert alone.outputs[0].token_ids != base.outputs[0].token_ids
