from pathlib import Path

import pytest

QWEN3_TEMPLATE = Path(__file__).parent.parent / "data" / "qwen3_chat_template.jinja"


@pytest.fixture(scope="session")
def reasoning_server():
    """The embedded model behind Qwen3's chat template with --reasoning-parser qwen3,
    and a response store of two (one server for both: a start costs seconds)."""
    from tests.serving import start_server

    srv = start_server("smollm2-135m", "--reasoning-parser", "qwen3", "--chat-template",
                       str(QWEN3_TEMPLATE), "--responses-store-size", "2")
    yield srv
    srv.stop()
