import weakref

import pytest

# every in-process engine a test built, so that its KV books are checked after it
_engines: weakref.WeakSet = weakref.WeakSet()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A random-weight 4-layer Llama with SmolLM2's tokenizer (write_tiny_llama)."""
    from tests.speculative.conftest import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session", autouse=True)
def _track_engines():
    from tokenmill.engine.core.llm_engine import LLMEngine

    init = LLMEngine.__init__

    def tracking_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _engines.add(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LLMEngine, "__init__", tracking_init)
        yield


@pytest.fixture(autouse=True)
def _kv_integrity_after_each_test(_track_engines):
    """After every test, each engine it ran (or that is still alive from a shared
    fixture) must have consistent KV books: ref counts match the live block
    tables, the free list and prefix cache agree (BlockManager.check_integrity).
    Engines still serving requests are skipped: a server thread may be stepping."""
    yield
    for engine in list(_engines):
        if not engine.has_unfinished_requests():
            engine.check_kv_integrity()


@pytest.fixture(scope="session")
def server():
    """One real `tokenmill serve` on the embedded model, shared by server and bench tests.

    Tests that kill or reconfigure a server start their own with tests.serving.start_server.
    """
    from tests.serving import start_server

    srv = start_server("smollm2-135m", "--max-num-seqs", "32")
    yield srv
    srv.stop()
