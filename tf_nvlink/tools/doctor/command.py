"""`tf-nvlink doctor` (also `python -m tf_nvlink.tools.doctor`): one fit of a benchmark model with the step
doctor; prints its table and writes step_doctor.json/.png to --output_dir. For the Transformers the report has the
model's MFU (`bench_models.transformer_flops_per_step`).

    tf-nvlink doctor --model resnet50 --batch_per_replica 128 --output_dir doctor
    tf-nvlink doctor --model resnet50 --log_dir logs     # then: tensorboard --logdir logs (Profile tab)
    tf-nvlink doctor --model convnet --batch_per_replica 8 --cpu_devices 2   # no GPU: says why
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Optional, Sequence

from tf_nvlink.tools.bench_models import BENCH_MODELS, model_flops_per_step
from tf_nvlink.util.cli_args import non_negative, positive, require_module, run_as_module, usage_error

HELP = "one fit of a benchmark model with the step doctor: where the step time goes, a verdict and advice"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `tf-nvlink doctor` options."""
    parser.add_argument("--model", default="resnet50", choices=BENCH_MODELS)
    parser.add_argument("--batch_per_replica", type=positive, default=128)
    parser.add_argument("--steps_per_execution", type=positive, default=1)
    parser.add_argument("--warmup_steps", type=positive, default=20)
    parser.add_argument("--window_steps", type=positive, default=10)
    parser.add_argument("--cpu_devices", type=non_negative, default=0,
                        help="logical CPU replicas instead of GPUs (0: GPUs)")
    parser.add_argument("--output_dir", default="step_doctor", help="step_doctor.json and step_doctor.png go here")
    parser.add_argument("--chart", action=argparse.BooleanOptionalAction, default=None,
                        help="step_doctor.png and its TensorBoard image (matplotlib, imported when the flags are "
                             "read; default: when matplotlib is installed)")
    parser.add_argument("--log_dir", default=None,
                        help="a TensorBoard log_dir: the trace goes to its train run (the Profile tab reads it), the "
                             "table and the chart to its step_doctor run (default: the trace under --output_dir)")


def chart_wanted(args: argparse.Namespace) -> bool:
    """Whether to draw the chart, decided before any training: --chart needs matplotlib; by default it is drawn
    when matplotlib is installed, and one installed but broken stops the command now (exit 2, the fix named)."""
    if args.chart is False:
        return False
    if args.chart is None and importlib.util.find_spec("matplotlib") is None:
        return False
    try:
        require_module("matplotlib.pyplot", "the chart", "pip install --force-reinstall matplotlib, or pass "
                                                         "--no-chart")
    except argparse.ArgumentTypeError as exc:
        usage_error(args, str(exc))
    return True


def run(args: argparse.Namespace) -> int:
    """`tf-nvlink doctor`: the fit and the doctor's files; 0 also when the doctor says why it has no breakdown."""
    chart = chart_wanted(args)
    from tf_nvlink.tools.doctor import bench  # noqa: PLC0415 - TensorFlow, once the flags are good

    strategy = bench.configure(cpu_devices=args.cpu_devices)
    model, dataset, global_batch = bench.build(args.model, strategy, args.batch_per_replica,
                                               args.steps_per_execution)
    doctor = bench.doctor_fit(model, dataset, global_batch, args.output_dir, args.warmup_steps, args.window_steps,
                              log_dir=args.log_dir, chart=chart,
                              model_flops_per_step=model_flops_per_step(args.model, global_batch))
    print(f"step doctor: {doctor.files.get('json')}" + (f" ({doctor.unavailable})" if doctor.unavailable else ""))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m tf_nvlink.tools.doctor ...`: the same as `tf-nvlink doctor ...`."""
    return run_as_module("tf_nvlink.tools.doctor", HELP, add_arguments, run, argv)
