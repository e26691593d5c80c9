import pytest


@pytest.fixture(scope="session")
def server():
    """One real `tokenmill serve` on the embedded model, shared by server and bench tests.

    Tests that kill or reconfigure a server start their own with tests.serving.start_server.
    """
    from tests.serving import start_server

    srv = start_server("smollm2-135m", "--max-num-seqs", "32")
    yield srv
    srv.stop()
