"""`python -m specexec.bench [options]`: the same as `specexec bench [options]`."""

import sys

from specexec.bench.cli import main

sys.exit(main())
