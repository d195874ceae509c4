"""`python -m tf_nvlink.costmodel --compute_ms 39.7 --gradient_mib 97.5`."""

import sys

from tf_nvlink.costmodel.table import main

sys.exit(main())
