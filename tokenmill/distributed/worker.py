"""Old entry point kept for command lines written before the layout of issue #55:
`python -m tokenmill.engine.executor.worker ...` runs `tokenmill.engine.executor.worker`.

Run by name, not imported: distributed/ sits below engine/ (docs/architecture.md).
"""

if __name__ == "__main__":
    import runpy

    runpy.run_module("tokenmill.engine.executor.worker", run_name="__main__", alter_sys=True)
