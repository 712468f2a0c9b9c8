"""Entry point for ``python -m benchmarks.resume_benchmark``: the benchmark (:mod:`.cli`), or
with ``megatron-lm`` before any ``--`` the Megatron-LM client (:mod:`.megatron_lm`)."""

import signal
import sys
from collections.abc import Sequence

from benchmarks.resume_benchmark import cli, megatron_lm


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark or the client with ``argv`` (default: the command line)."""
    signal.signal(signal.SIGTERM, cli.exit_on_sigterm)
    args = list(sys.argv[1:] if argv is None else argv)
    head = args[: args.index("--")] if "--" in args else args
    if cli.CLIENT_COMMAND in head:
        args.remove(cli.CLIENT_COMMAND)
        return megatron_lm.main(args)
    return cli.main(args)


if __name__ == "__main__":
    raise SystemExit(main())
