"""`tokenmill worker`: this node's tensor-parallel ranks for an engine on node 0
(the worker itself: tokenmill/engine/executor/worker.py)."""

from __future__ import annotations

import argparse

from tokenmill.engine.executor.worker import add_worker_args, run_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run this node's tensor-parallel ranks for an engine "
                       "on node 0 (multi-node tensor parallelism)")
    add_worker_args(p)
    p.set_defaults(func=run_from_args)
