"""The seed's "device_lib / NVLink check": which GPUs TensorFlow sees, how NVLink joins them, what tf_nvlink plans.

    python examples/report.py            # text: nvidia-smi-style matrix, NVLink table, TensorFlow's view, plan
    python examples/report.py --json     # the same data as JSON
    python examples/report.py --no_tf    # NVML only: instant, does not initialise the GPUs

Same as `tf-nvlink report`; needs the package importable (`pip install -e .`, or run from the repository root).
"""

import sys
from pathlib import Path

from absl import app, flags

try:
    from tf_nvlink.tools import report
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tf_nvlink.tools import report

_JSON = flags.DEFINE_bool("json", False, "Print the report as JSON instead of text.")
_NO_TF = flags.DEFINE_bool("no_tf", False, "Skip TensorFlow: NVML facts and the plan only (instant).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    data = report.collect(with_tf=not _NO_TF.value)
    print(report.to_json(data) if _JSON.value else report.render_text(data), end="\n" if _JSON.value else "")


if __name__ == "__main__":
    app.run(main)
