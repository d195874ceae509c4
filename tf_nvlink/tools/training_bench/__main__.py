"""`python -m tf_nvlink.tools.training_bench`: the training benchmark (see `cli`)."""

from tf_nvlink.tools.training_bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
