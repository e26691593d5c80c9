"""`tokenmill serve --async-scheduling`: the engine core steps with outputs one step
late, and the last step brings outputs without running a batch; concurrent streams
still get exactly offline greedy's text, stop strings included."""

import asyncio

import openai
import pytest

from tests.serving import start_server
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [f"Here is one short sentence about {s}:" for s in
           ("the sea", "a city", "music", "winter", "a cat", "the moon")]
MAX_TOKENS = [3, 12, 7, 1, 10, 5]


def test_streams_under_async_scheduling_match_offline_greedy():
    srv = start_server("smollm2-135m", "--dtype", "float32", "--max-num-seqs", "8",
                       "--async-scheduling")
    try:
        client = openai.AsyncOpenAI(base_url=f"{srv.base_url}/v1", api_key="unused",
                                    max_retries=0, timeout=300)

        async def one(prompt: str, max_tokens: int, stop: list[str] | None):
            stream = await client.completions.create(
                model="smollm2-135m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                stop=stop, stream=True)
            text, reason = "", None
            async for chunk in stream:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            return text, reason

        offline = LLM(model="smollm2-135m", dtype="float32").generate(
            PROMPTS, [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS],
            use_tqdm=False)
        expected = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in offline]
        # a stop string from the middle of the longest answer
        long_text = expected[1][0]
        stop = long_text[len(long_text) // 2:len(long_text) // 2 + 2]
        stops = [None, [stop], None, None, None, None]

        async def everyone():
            return await asyncio.gather(*(one(p, m, s)
                                          for p, m, s in zip(PROMPTS, MAX_TOKENS, stops)))

        served = asyncio.run(everyone())
        assert served[1] == (long_text[:long_text.index(stop)], "stop")
        assert served[:1] + served[2:] == expected[:1] + expected[2:]
    finally:
        srv.stop()
