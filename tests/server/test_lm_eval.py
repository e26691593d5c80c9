"""lm-eval-harness 0.4.13 against the server: a loglikelihood multiple-choice task
over 20 local examples (tests/data/lm_eval), through `local-completions`, agrees
with the same task run through transformers on the same weights.

lm-eval is not in the test extra (it pulls in datasets, evaluate, sacrebleu, ...):
`pip install 'lm-eval[api]==0.4.13'` to run this; test_completions_batch_echo.py keeps
the exact request shape lm-eval sends under test without it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
TASK = "tokenmill_tiny_mc"
DATA = Path(__file__).parents[1] / "data" / "lm_eval"


@pytest.fixture
def task_dir(tmp_path, monkeypatch):
    """The shipped YAML with its data path made absolute; the Hub is never asked."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = (DATA / "tiny_mc.yaml").read_text()
    (tmp_path / "tiny_mc.yaml").write_text(
        text.replace("tests/data/lm_eval/tiny_mc.jsonl", str(DATA / "tiny_mc.jsonl")))
    return tmp_path


def _evaluate(model, task_dir: Path, model_args: str | None = None) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=[TASK],
                           task_manager=TaskManager(include_path=str(task_dir)),
                           batch_size=8, log_samples=True)


def _per_doc(result: dict) -> dict[int, float]:
    return {s["doc_id"]: s["acc"] for s in result["samples"][TASK]}


def test_lm_eval_through_the_server_agrees_with_transformers(task_dir):
    for module in ("lm_eval", "tenacity", "aiohttp"):
        pytest.importorskip(module, reason="lm-eval-harness not installed "
                            "(pip install 'lm-eval[api]==0.4.13'); not part of make test")
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.serving import start_server
    from tokenmill.loaders import load_tokenizer, resolve_model

    source = resolve_model(MODEL)
    tokenizer_dir = load_tokenizer(source).name_or_path  # tokenmill's saved HF tokenizer
    srv = start_server(MODEL, "--dtype", "float32", "--quantization", "none")
    try:
        served = _evaluate("local-completions", task_dir,
                           f"model={MODEL},base_url={srv.base_url}/v1/completions,"
                           f"tokenizer_backend=huggingface,tokenizer={tokenizer_dir}")
    finally:
        srv.stop()
    reference = AutoModelForCausalLM.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32).eval()
    direct = _evaluate(HFLM(pretrained=reference,
                            tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
                            batch_size=8, device="cpu"), task_dir)
    acc_served = served["results"][TASK]["acc,none"]
    acc_direct = direct["results"][TASK]["acc,none"]
    print(f"{TASK}: acc {acc_served:.2f} through the server, {acc_direct:.2f} via transformers")
    served_docs, direct_docs = _per_doc(served), _per_doc(direct)
    assert len(served_docs) == 20
    # fp32 both sides: the same choice on every question, bar a near-tie
    agree = sum(served_docs[d] == direct_docs[d] for d in served_docs)
    assert agree >= 19 and abs(acc_served - acc_direct) <= 0.05
    assert acc_served > 0.25  # better than chance over four choices
