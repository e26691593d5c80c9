"""A tensor-parallel worker that dies before it joins the group fails start-up
with its exit code and its last words, instead of rank 0 waiting out the TCP
store's 10-minute timeout (issue 64)."""

from __future__ import annotations

import os

import pytest

from tokenmill import LLM
from tokenmill.distributed.errors import TensorParallelError

pytestmark = pytest.mark.slow


def test_a_worker_that_dies_before_joining_fails_start_up_with_its_error(tmp_path, monkeypatch):
    from tests.speculative.conftest import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny", num_layers=1)
    # the worker process (only it: rank 0 is this process, already running) imports
    # this sitecustomize first and dies as a broken install or a bad flag would
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import sys\n"
        "if 'tokenmill.engine.executor.worker' in ' '.join(sys.argv) or '--rank' in sys.argv:\n"
        "    sys.stderr.write('simulated worker crash: CUDA driver not found\\n')\n"
        "    sys.stderr.flush()\n    import os\n    os._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", f"{hooks}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with pytest.raises(TensorParallelError, match=r"rank 1 .*exited with code 3 before it "
                       r"joined(.|\n)*simulated worker crash"):
        LLM(model, dtype="float32", num_kv_blocks=16, tensor_parallel_size=2)
