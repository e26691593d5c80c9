"""`python -m benchmarks list | run NAME|all [options] | report`."""

from benchmarks.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
