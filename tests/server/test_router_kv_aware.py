"""Two tokenmill replicas behind vllm-router's `kv_aware` policy: the router follows
each replica's KV events and sends a prompt to the replica that holds its prefix."""

import time

import httpx
import pytest

from benchmarks.server import router_binary, running_router
from tests.serving import free_port, start_server

pytestmark = pytest.mark.slow

ROUTER = router_binary()


def _prefix_cache_hits(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("tokenmill:prefix_cache_hits_total"))


def _complete(base_url: str, prompt: str) -> None:
    r = httpx.post(f"{base_url}/v1/completions", timeout=120,
                   json={"model": "smollm2-135m", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def replicas():
    if ROUTER is None:
        pytest.skip("vllm-router is not installed (pip install vllm-router==0.1.17)")
    ports = [free_port(), free_port()]
    servers = [start_server(
        "smollm2-135m", "--max-num-seqs", "4", "--kv-cache-memory", "128MiB",
        "--kv-events-config",
        f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{p}"}}')
        for p in ports]
    args = ["--worker-urls", *[s.base_url for s in servers], "--policy", "kv_aware",
            "--kv-event-block-size", "16", "--kv-event-model", "smollm2-135m"]
    for s, p in zip(servers, ports):
        args += ["--kv-event-source", f"{s.base_url}=tcp://127.0.0.1:{p}"]
    try:
        with running_router(args, log_path=f"/tmp/vllm-router-{free_port()}.log") as url:
            yield url, servers
    finally:
        for s in servers:
            s.stop()


def test_a_prompt_goes_to_the_replica_that_holds_its_prefix(replicas):
    router, servers = replicas
    prefix_a = " ".join(f"alpha{i} beta" for i in range(150))
    prefix_b = " ".join(f"gamma{i} delta" for i in range(150))
    # the router's own choice for a prompt nobody holds, on equal load
    before = [_prefix_cache_hits(s.base_url) for s in servers]
    _complete(router, prefix_a)
    _complete(router, prefix_a)  # a repeat hits the replica A landed on
    after = [_prefix_cache_hits(s.base_url) for s in servers]
    default = max(range(2), key=lambda i: after[i] - before[i])
    other = 1 - default
    # B computed on the other replica, behind the router's back: only its KV
    # events tell the router where B lives
    _complete(servers[other].base_url, prefix_b)
    time.sleep(1.0)  # events travel asynchronously
    hits = [_prefix_cache_hits(s.base_url) for s in servers]
    _complete(router, prefix_b + " and more")
    gained = [_prefix_cache_hits(s.base_url) - h for s, h in zip(servers, hits)]
    assert gained[other] >= 400, f"B was not routed to the replica holding it: {gained}"
    assert gained[default] == 0
