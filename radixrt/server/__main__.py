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
        allow_abbrev=False,
    )
    add_serve_command(parser)
    args = parser.parse_args()
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad flags: a clear message, no traceback (as `radixrt serve`)
        print(f"radixrt serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
