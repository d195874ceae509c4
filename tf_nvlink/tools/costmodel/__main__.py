"""`python -m tf_nvlink.tools.costmodel --compute_ms 39.7 --gradient_mib 97.5`."""

import sys

from tf_nvlink.tools.costmodel.table import main

sys.exit(main())
