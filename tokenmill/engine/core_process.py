"""Old entry point kept for supervisors and scripts written before the layout of
issue #55: `python -m tokenmill.engine.frontend.core_process ...` runs the engine core,
tokenmill.engine.frontend.core_process (which `tokenmill serve` itself starts)."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("tokenmill.engine.frontend.core_process", run_name="__main__",
                     alter_sys=True)
