"""`tokenmill generate` and `tokenmill chat` end to end, as a terminal user runs them."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _cli(*argv: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *argv], input=stdin,
                          capture_output=True, text=True, timeout=600, check=False)


def test_generate_prints_the_greedy_continuation(llm):
    from tokenmill import SamplingParams

    prompt = "The capital of France is"
    proc = _cli("generate", prompt, "--max-tokens", "8", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    expected = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8),
                            use_tqdm=False)[0].outputs[0].text
    assert proc.stdout == expected + "\n"


def test_generate_rejects_bad_sampling_with_exit_2():
    proc = _cli("generate", "x", "--temperature", "-1")
    assert proc.returncode == 2 and "error:" in proc.stderr


def test_chat_answers_turn_after_turn_and_quits_on_an_empty_line():
    proc = _cli("chat", "--max-tokens", "24", "--dtype", "float32",
                stdin="What is the capital of France? Answer in one word.\nAnd Italy's?\n\n")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("tokenmill chat · smollm2-135m")
    replies = [line for line in lines[1:] if line.startswith("> ")]
    assert len(replies) == 3  # two turns, then the empty line that quits
    assert "Paris" in replies[0]
    assert replies[1].strip("> ").strip()  # the second turn got an answer too
