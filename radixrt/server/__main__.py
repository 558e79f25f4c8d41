"""`python -m radixrt.server [flags]`: the same as `radixrt serve`."""
import argparse
import sys

from radixrt.server.launch import add_serve_args, serve_main


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m radixrt.server",
                                     description="radixrt HTTP server (SGLang-native and OpenAI-compatible)")
    add_serve_args(parser)
    return serve_main(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
