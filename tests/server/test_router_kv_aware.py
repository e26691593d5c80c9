"""Two tokenmill replicas behind vllm-router's `kv_aware` policy: the router follows
each replica's KV events and sends a prompt to the replica that holds its prefix."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.serving import free_port, start_server

pytestmark = pytest.mark.slow

ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or \
    shutil.which("vllm-router")


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
    router_port = free_port()
    cmd = [ROUTER, "--host", "127.0.0.1", "--port", str(router_port),
           "--worker-urls", *[s.base_url for s in servers], "--policy", "kv_aware",
           "--kv-event-block-size", "16", "--kv-event-model", "smollm2-135m",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    for s, p in zip(servers, ports):
        cmd += ["--kv-event-source", f"{s.base_url}=tcp://127.0.0.1:{p}"]
    log = open(os.path.join("/tmp", f"vllm-router-{router_port}.log"), "w")  # noqa: SIM115
    router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{router_port}"
    try:
        for _ in range(120):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert router.poll() is None, "vllm-router exited"
            time.sleep(0.5)
        yield url, servers
    finally:
        router.terminate()
        router.wait(10)
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
