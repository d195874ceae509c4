"""`tf-nvlink doctor` (also `python -m tf_nvlink.tools.doctor`): one fit of a benchmark model with the step
doctor; prints its table and writes step_doctor.json/.png to --output_dir. For the Transformers the report has the
model's MFU (`bench_models.transformer_flops_per_step`). With --reread, no training: a saved run's trace read again
by the current doctor (`reread`), on any machine.

    tf-nvlink doctor --model resnet50 --batch_per_replica 128 --output_dir doctor
    tf-nvlink doctor --model resnet50 --log_dir logs     # then: tensorboard --logdir logs (Profile tab)
    tf-nvlink doctor --model convnet --batch_per_replica 8 --cpu_devices 2   # no GPU: says why
    tf-nvlink doctor --reread doctor                     # the run in doctor/ read again -> doctor/reread/
    tf-nvlink doctor --reread runs/step_doctor.json --trace runs/resnet50.xplane.pb.gz --output_dir again
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Optional, Sequence

from tf_nvlink.tools.bench_models import BENCH_MODELS, model_flops_per_step
from tf_nvlink.util.cli_args import non_negative, positive, require_module, run_as_module, usage_error

HELP = ("one fit of a benchmark model with the step doctor: where the step time goes, a verdict and advice "
        "(--reread: a saved run read again, no training)")
# The flags of a training run, which a re-read does not take.
LIVE_FLAGS = ("model", "batch_per_replica", "steps_per_execution", "warmup_steps", "window_steps", "cpu_devices",
              "log_dir")
DEFAULT_OUTPUT_DIR = "step_doctor"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `tf-nvlink doctor` options."""
    parser.add_argument("--model", default="resnet50", choices=BENCH_MODELS)
    parser.add_argument("--batch_per_replica", type=positive, default=128)
    parser.add_argument("--steps_per_execution", type=positive, default=1)
    parser.add_argument("--warmup_steps", type=positive, default=20)
    parser.add_argument("--window_steps", type=positive, default=10)
    parser.add_argument("--cpu_devices", type=non_negative, default=0,
                        help="logical CPU replicas instead of GPUs (0: GPUs)")
    parser.add_argument("--output_dir", default=None,
                        help=f"step_doctor.json and step_doctor.png go here (default: {DEFAULT_OUTPUT_DIR}; with "
                             f"--reread, reread/ in the saved run's folder)")
    parser.add_argument("--chart", action=argparse.BooleanOptionalAction, default=None,
                        help="step_doctor.png and its TensorBoard image (matplotlib, imported when the flags are "
                             "read; default: when matplotlib is installed)")
    parser.add_argument("--log_dir", default=None,
                        help="a TensorBoard log_dir: the trace goes to its train run (the Profile tab reads it), the "
                             "table and the chart to its step_doctor run (default: the trace under --output_dir)")
    parser.add_argument("--reread", default=None, metavar="DIR_OR_JSON",
                        help="no training: re-read a saved run (its step_doctor.json, or the folder holding it) with "
                             "the current doctor, from the run's window and context; prints the table and writes the "
                             "new step_doctor.json to --output_dir")
    parser.add_argument("--trace", default=None, metavar="PATH",
                        help="with --reread: the run's trace (.xplane.pb or .xplane.pb.gz, or a folder holding one); "
                             "default: the path the report holds, else the newest trace in its folder or below, "
                             "else <its folder>.xplane.pb.gz")


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
    """`tf-nvlink doctor`: the fit and the doctor's files (or, with --reread, a saved run read again); 0 also when
    the doctor says why it has no breakdown."""
    if args.reread is not None:
        return run_reread(args)
    if args.trace is not None:
        usage_error(args, "--trace is read with --reread (a saved run's trace); a training run writes its own")
    args.output_dir = args.output_dir or DEFAULT_OUTPUT_DIR
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


def run_reread(args: argparse.Namespace) -> int:
    """`tf-nvlink doctor --reread`: the saved run's trace read again (`reread.reread`), the table printed, the new
    step_doctor.json (and .png) written to --output_dir; exit 2 with one line for a missing report or trace.

    Example:
        >>> run_reread(parse(["doctor", "--reread", "doctor_mfu/transformer_compiled", "--output_dir", "again"]))
        0
    """
    defaults = {flag: parser_default for flag, parser_default in vars(_defaults()).items() if flag in LIVE_FLAGS}
    given = [f"--{flag}" for flag, value in defaults.items() if getattr(args, flag) != value]
    if given:
        usage_error(args, f"--reread reads a saved run: {', '.join(given)} belong to a training run (the re-read "
                          f"takes --trace, --output_dir and --chart)")
    chart = chart_wanted(args)
    from tf_nvlink.tools.doctor import outputs, reread  # noqa: PLC0415 - TensorFlow, once the flags are good

    try:
        report, why = reread.reread(args.reread, trace=args.trace)
    except reread.RereadError as exc:
        return usage_error(args, f"--reread: {exc}")
    output_dir = args.output_dir or os.path.join(os.path.dirname(report["reread"]["report"]), "reread")
    if why:
        print(f"step doctor: no step breakdown: {why}")
    else:
        print(outputs.render_table(report))
        if chart:
            outputs.write_chart(report, os.path.join(output_dir, "step_doctor.png"))
    path = outputs.write_json(report, os.path.join(output_dir, "step_doctor.json"))
    print(f"step doctor: {path} (re-read {report['reread']['report']} with the trace {report['trace']})")
    return 0


def _defaults() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m tf_nvlink.tools.doctor ...`: the same as `tf-nvlink doctor ...`."""
    return run_as_module("tf_nvlink.tools.doctor", HELP, add_arguments, run, argv)
