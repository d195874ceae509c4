"""`python -m tf_nvlink.tools.allreduce_bench ...`: the same as `tf-nvlink bench ...`."""

import sys

from tf_nvlink.tools.allreduce_bench.cli import main

sys.exit(main())
