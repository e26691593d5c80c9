"""Continuous batching under concurrent streaming clients: everyone finishes, and
greedy outputs are the ones offline `LLM.generate` gives for the same prompts."""

import asyncio

import openai
import pytest

from tests.serving import start_server
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

SUBJECTS = ["the sea", "a city", "music", "winter", "a cat", "the moon", "bread", "rain",
            "a river", "the forest", "chess", "coffee", "a train", "the desert", "a robot",
            "gardens", "bees", "a library", "the wind", "mountains", "a lighthouse", "snow",
            "tea", "a bridge", "clocks", "the sun", "a violin", "islands", "paper", "fire",
            "a market", "stars"]
PROMPTS = [f"Here is one short sentence about {s}:" for s in SUBJECTS]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def fp32_server():
    # float32: in bfloat16 the batch a sequence shares changes the last bits of its
    # logits, so greedy picks can flip between the served and the offline batches
    srv = start_server("smollm2-135m", "--dtype", "float32", "--max-num-seqs", "32")
    yield srv
    srv.stop()


def test_32_concurrent_streams_match_offline_greedy(fp32_server):
    client = openai.AsyncOpenAI(base_url=f"{fp32_server.base_url}/v1", api_key="unused",
                                max_retries=0, timeout=300)

    async def one(prompt: str) -> tuple[str, str | None]:
        stream = await client.completions.create(
            model="smollm2-135m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            stream=True)
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def everyone():
        return await asyncio.gather(*(one(prompt) for prompt in PROMPTS))

    served = asyncio.run(everyone())
    assert len(served) == 32 and all(reason in ("length", "stop") for _, reason in served)

    offline = LLM(model="smollm2-135m", dtype="float32").generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    expected = [out.outputs[0].text for out in offline]
    assert [text for text, _ in served] == expected
