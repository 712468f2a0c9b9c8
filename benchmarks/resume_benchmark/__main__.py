"""Entry point for ``python -m benchmarks.resume_benchmark`` (:mod:`.cli`)."""

from benchmarks.resume_benchmark.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
