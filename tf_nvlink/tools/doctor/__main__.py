"""`python -m tf_nvlink.tools.doctor --model resnet50`: one fit of a benchmark model with the step doctor; prints
its table and writes step_doctor.json/.png to --output_dir.

    python -m tf_nvlink.tools.doctor --model resnet50 --batch_per_replica 128 --output_dir doctor
    python -m tf_nvlink.tools.doctor --model convnet --batch_per_replica 8 --cpu_devices 2   # no GPU: says why
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from tf_nvlink.tools.bench_models import BENCH_MODELS


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tf_nvlink.tools.doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet50", choices=BENCH_MODELS)
    parser.add_argument("--batch_per_replica", type=int, default=128)
    parser.add_argument("--steps_per_execution", type=int, default=1)
    parser.add_argument("--warmup_steps", type=int, default=20)
    parser.add_argument("--window_steps", type=int, default=10)
    parser.add_argument("--cpu_devices", type=int, default=0, help="logical CPU replicas instead of GPUs (0: GPUs)")
    parser.add_argument("--output_dir", default="step_doctor")
    args = parser.parse_args(argv)
    for name in ("batch_per_replica", "steps_per_execution", "warmup_steps", "window_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} should be a positive integer. Received: {getattr(args, name)}")
    from tf_nvlink.tools.doctor import bench

    strategy = bench.configure(cpu_devices=args.cpu_devices)
    model, dataset, global_batch = bench.build(args.model, strategy, args.batch_per_replica,
                                               args.steps_per_execution)
    doctor = bench.doctor_fit(model, dataset, global_batch, args.output_dir, args.warmup_steps, args.window_steps)
    print(f"step doctor: {doctor.files.get('json')}" + (f" ({doctor.unavailable})" if doctor.unavailable else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
