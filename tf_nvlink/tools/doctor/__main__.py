"""`python -m tf_nvlink.tools.doctor`: the same as `tf-nvlink doctor` (`tf_nvlink.tools.doctor.command`)."""

import sys

from tf_nvlink.tools.doctor.command import main

if __name__ == "__main__":
    sys.exit(main())
