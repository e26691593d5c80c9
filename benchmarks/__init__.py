"""tokenmill's benchmarks, one tool: `python -m benchmarks list | run NAME | report`.

workloads/ are PERFORMANCE.md's W1-W5 (tokenmill beside its peers in the same run),
features/ measure one feature against its absence, kernels/ are micro-benchmarks of
one kernel; peers/ sets up and runs vLLM's CPU backend and llama.cpp. Every run of a
workload writes its figures to benchmarks/results/ (results.py); `report` turns the
results into BENCHMARKS.md (report.py).
"""
