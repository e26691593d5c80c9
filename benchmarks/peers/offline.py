"""Peers without a server: llama-bench, and vLLM's offline `LLM` in its own venv."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from .servers import vllm_env

HERE = Path(__file__).resolve().parent


def proc_peak_rss_kib(pid: int) -> int:
    """A live process's peak resident memory (VmHWM, KiB); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def run_llama_bench(llama, gguf: Path, prompt_len: int, gen_len: int, threads: int = 2,
                    repetitions: int = 5, timeout_s: float = 1800.0) -> dict:
    """`llama-bench -p P -n N -t 2 -r R -o json`: one test (pp P when N is 0, tg N
    when P is 0). Returns {"tok_s", "stddev_tok_s", "samples_tok_s", "command",
    "peak_rss_mib", "build", "type"}."""
    cmd = [str(llama.bench), "-m", str(gguf), "-p", str(prompt_len), "-n", str(gen_len),
           "-t", str(threads), "-r", str(repetitions), "-o", "json"]
    print(f"[peers] $ {' '.join(cmd)}", flush=True)
    # Its own peak RSS: the exec'd process's VmHWM, read while it runs. Not wait4's
    # ru_maxrss, which Linux carries over from the parent's memory at fork/exec (a child
    # of a 1 GB Python process reads >= 1 GB whatever it uses).
    peak_kib = 0
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None:
            peak_kib = max(peak_kib, proc_peak_rss_kib(proc.pid))
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"llama-bench did not finish in {timeout_s:.0f} s")
            time.sleep(0.02)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench exited with {proc.returncode}:\n{stderr[-3000:]}")
    tests = json.loads(stdout)
    if len(tests) != 1:
        raise RuntimeError(f"llama-bench printed {len(tests)} tests, expected one")
    t = tests[0]
    return {"tok_s": float(t["avg_ts"]), "stddev_tok_s": float(t["stddev_ts"]),
            "samples_tok_s": [float(x) for x in t.get("samples_ts", [])],
            "command": " ".join(cmd), "peak_rss_mib": peak_kib / 1024 or None,
            # the vendored source reports no commit: its build folder names the version
            "build": (t.get("build_commit") if t.get("build_commit") not in (None, "", "unknown")
                      else Path(llama.bench).parent.parent.name),
            "type": t.get("model_type", "")}


def run_vllm_offline(vllm, requests: list[tuple[list[int], int]], threads: str = "both",
                     timeout_s: float = 3600.0) -> dict:
    """vLLM's `LLM.generate` over (prompt_token_ids, max_tokens) requests, greedy,
    ignore_eos, in a subprocess of vLLM's venv (vllm_offline_driver.py). Returns
    {"output_tokens", "elapsed_s", "startup_s", "tok_s"}; the subprocess and the
    engine process it spawns end with it."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="vllm-w1-",
                                     delete=False) as f:
        json.dump([[list(p), m] for p, m in requests], f)
    cmd = [str(vllm.python), str(HERE / "vllm_offline_driver.py"), str(vllm.model_dir), f.name]
    print(f"[peers] vLLM offline ({threads} cores): {len(requests)} requests "
          f"(start-up 90-110 s on a quiet machine)", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=vllm_env(threads), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise RuntimeError(f"vLLM offline did not finish in {timeout_s:.0f} s") from None
    finally:
        os.unlink(f.name)
        try:  # its engine process, should it outlive the driver
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
    lines = [x for x in out.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM offline exited with {proc.returncode}:\n{err[-3000:]}")
    result = json.loads(lines[-1])
    result["tok_s"] = result["output_tokens"] / result["elapsed_s"]
    return result
