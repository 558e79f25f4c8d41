"""``python -m radixrt.bench``: the same as ``radixrt bench``."""

import sys

from radixrt.bench.main import main

sys.exit(main(prog="python -m radixrt.bench"))
