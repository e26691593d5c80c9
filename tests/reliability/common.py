"""Helpers the reliability tests share: a background stream whose chunk gaps
are recorded, and the server's KV usage and running count from /metrics."""

from __future__ import annotations

import itertools
import threading
import time

import httpx


class BackgroundStream:
    """A greedy completion streamed in a thread; `gaps_s` are its inter-chunk times."""

    def __init__(self, base_url: str, max_tokens: int = 400,
                 headers: dict[str, str] | None = None) -> None:
        self.base_url, self.max_tokens, self.headers = base_url, max_tokens, headers or {}
        self.arrivals: list[float] = []
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{self.base_url}/v1/completions", json=body,
                          headers=self.headers, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.arrivals.append(time.monotonic())
                    if len(self.arrivals) == 5:
                        self.started.set()

    def __enter__(self) -> BackgroundStream:  # noqa: PYI034
        self.thread.start()
        assert self.started.wait(120), "the background stream never started"
        self.window_start = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.window_end = time.monotonic()
        self.thread.join(300)

    def max_gap_in_window(self) -> tuple[float, float]:
        """The longest gap between chunks that overlaps the `with` block, and when it ended."""
        return max(((b - a, b) for a, b in itertools.pairwise(self.arrivals)
                    if b >= self.window_start and a <= self.window_end), default=(0.0, 0.0))


def metric(base_url: str, suffix: str, headers: dict[str, str] | None = None) -> float:
    text = httpx.get(f"{base_url}/metrics", headers=headers or {}, timeout=30).text
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if not line.startswith("#") and name.endswith(suffix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric *{suffix} in /metrics")


def wait_idle(base_url: str, timeout_s: float = 30.0,
              headers: dict[str, str] | None = None) -> None:
    """Nothing running and every KV block back (usage 0), or fail."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = metric(base_url, ":num_requests_running", headers)
        usage = metric(base_url, ":kv_cache_usage_perc", headers)
        if running == 0 and usage == 0:
            return
        assert time.monotonic() < deadline, f"running={running}, kv usage={usage}"
        time.sleep(0.2)
