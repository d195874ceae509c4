"""`python -m tf_nvlink.bench ...`: the same as `tf-nvlink bench ...`."""

import sys

from tf_nvlink.bench.cli import main

sys.exit(main())
