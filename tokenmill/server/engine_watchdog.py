"""A front end whose engine died exits non-zero, so a supervisor (systemd,
Kubernetes, docker --restart) restarts the pair: what vLLM does. Answering 503
forever only helps a supervisor that probes /health and is told to restart on
it; `--keep-serving-after-engine-death` keeps that behaviour.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_POLL_S = 0.1
_EXIT_WITHIN_S = 4.0  # in-flight requests have already ended with their error event


def exit_on_engine_death(server: Any, dead_reason: Callable[[], str | None]) -> Callable[[], bool]:
    """Watch `dead_reason` and, once it names a death, shut uvicorn down (forcibly if a
    connection lingers). Returns a function that tells whether that happened."""
    died = threading.Event()

    def watch() -> None:
        while not server.should_exit:
            reason = dead_reason()
            if reason is not None:
                died.set()
                logger.error("%s: exiting so that a supervisor restarts the server "
                             "(--keep-serving-after-engine-death keeps answering 503)", reason)
                server.config.timeout_graceful_shutdown = _EXIT_WITHIN_S / 2
                server.should_exit = True
                time.sleep(_EXIT_WITHIN_S)
                server.force_exit = True
                return
            time.sleep(_POLL_S)

    threading.Thread(target=watch, name="tokenmill-engine-watchdog", daemon=True).start()
    return died.is_set
