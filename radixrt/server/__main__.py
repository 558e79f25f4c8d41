"""`python -m radixrt.server [flags]`: the same as `radixrt serve` (radixrt/cli.py)."""

import argparse
import sys

from radixrt.cli import add_serve_command
from radixrt.help_format import HelpFormatter


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m radixrt.server",
        formatter_class=HelpFormatter,
        description="radixrt HTTP server (SGLang-native and OpenAI-compatible)",
    )
    add_serve_command(parser)
    args = parser.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
