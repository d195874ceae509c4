"""The verdict on a step breakdown (host-bound, input-bound, link-bound, compute-bound) and the changes that
help most, each with its predicted gain.

- host-bound: the GPU idles (waits for the host). Where the N steps of `steps_per_execution=N` run as one XLA
  program per replica (tf_nvlink's compiled execution), what the GPU waits for between calls (`boundary_idle`:
  the next batch fetched, the next program launched) is paid once per execution instead of once per call; the
  kernels of a step run as they did, the gaps between them included, and the input copies still run between
  executions (TensorFlow copies a batch after the kernels queued before it), from pinned host memory at
  PINNED_COPY_GB_PER_S. The predicted step is the measured one less the boundary's idle per step and less the
  exposed input copy, plus the pinned copy and the boundary's idle over N (what the traces of the compiled
  execution show, docs/results.md). On the per-step path (Keras' loop, which still launches the steps one by
  one) the per-call gap is paid once per call, and `GAP_REMOVED_BY_MULTI_STEP` of `gap * (calls per step - 1/N)`
  is saved. N is capped so that the staged batches (about 4N) take at most STAGED_MEMORY_SHARE of the device's
  free memory.
- input-bound: host-to-device copies not hidden behind compute. float32 input sent as uint8 moves a quarter of the
  bytes (saves 3/4 of the exposed copy); prefetching to the devices hides the copy (saves all of it).
- link-bound: the all-reduce not hidden behind compute. `allreduce_dtype="bfloat16"` halves the bytes: the saving is
  the exposed time times the share of the cost model's all-reduce time that the halved bytes remove;
  XLA's latency-hiding scheduler can hide at most the exposed time.
- compute-bound: the kernels fill the step; the trace predicts no gain from the changes above.

Whatever the verdict, it names the kinds of work furthest from their bound (`bounds.far_from_bound`: the time above
the bound set by their bytes at the GPU's memory bandwidth and their FLOPs at its peak) and what could be done about
each; those come without a predicted gain.

Example:
    >>> context = StepContext(replicas=1, steps_per_execution=1, gradient_bytes=102_236_160,
    ...                       gradient_tensors=161, per_replica_batch=128)
    >>> verdict = diagnose(mean_breakdown(replicas), context)
    >>> verdict.kind, verdict.advice[0].change
    ('host-bound', 'steps_per_execution=8')
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tf_nvlink.tools.costmodel import model as costmodel
from tf_nvlink.tools.doctor import bounds as work_bounds
from tf_nvlink.tools.doctor.breakdown import ReplicaBreakdown

VERDICTS = ("host-bound", "input-bound", "link-bound", "compute-bound")
# A cost below this fraction of the step is not worth a verdict: the step is then compute-bound.
BOUND_FRACTION = 0.15
STEPS_PER_EXECUTION_CHOICES = (2, 4, 8, 16, 32)
# steps_per_execution is raised until the per-call gap left per step is at most this fraction of the step.
REMAINING_GAP_FRACTION = 0.02
# The share of the per-call gap that Keras' multi-step loop removes: each step inside the loop still launches its
# XLA program and takes its batch from the iterator, so only part of the idle time between calls goes away. Fitted
# to the step doctor's runs on 1x H200 (docs/results.md: ResNet-50 0.61, the 368M Transformer 0.52 of the gap).
# Used only where the compiled execution does not apply (split mode, several workers, or turned off).
GAP_REMOVED_BY_MULTI_STEP = 0.55
# The compiled execution holds about 4N batches per device (the N staged, their stacked copy, the next N taken
# and N prefetched): N is chosen so that they take at most this share of the device's free memory.
STAGED_BATCHES = 4
STAGED_MEMORY_SHARE = 0.25
# Host-to-device copies from pinned memory on 1x H200 (PCIe gen5), the compiled execution's input: 41.5 and 40.0
# GB/s in two runs (docs/results.md). Used for the copy the compiled execution still pays per step.
PINNED_COPY_GB_PER_S = 40.0
LATENCY_HIDING_FLAG = "--xla_gpu_enable_latency_hiding_scheduler=true"


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What the doctor knows about the training besides the trace.

    replicas: replicas in sync; steps_per_execution: the model's; gradient_bytes: float32 bytes of the trainable
    variables; gradient_tensors: how many; per_replica_batch: samples per replica per step (0 when unknown);
    allreduce_dtype: the dtype the gradients cross the link in; float_input: the model takes float32 input
    (sent to the GPUs at 4 bytes an element); link: the cost model of this machine's GPUs (None: one GPU or no
    NVML); machine_kind: topology kind of the GPUs ("nvswitch", "nvlink-all", "pcie", "single", ...); xla_flags:
    the XLA_FLAGS the process runs with (tf_nvlink sets the latency-hiding scheduler for fused multi-GPU XLA);
    compiled_execution: steps_per_execution > 1 would run as one XLA program per replica
    (`tf_nvlink.training.compiled_execution.execution_path`); batch_bytes: one replica's input bytes per step;
    device_free_bytes: free bytes of a replica's device (0 when unknown).
    """

    replicas: int
    steps_per_execution: int
    gradient_bytes: int
    gradient_tensors: int
    per_replica_batch: int = 0
    allreduce_dtype: str = "float32"
    float_input: bool = False
    link: Optional[costmodel.LinkModel] = None
    machine_kind: str = "unknown"
    xla_flags: str = ""
    compiled_execution: bool = False
    batch_bytes: int = 0
    device_free_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Advice:
    """One change and its predicted step time: `gain` = step / predicted step - 1 (0.2 = 20% faster)."""

    change: str
    why: str
    saved_ms: float
    predicted_step_ms: float
    gain: float

    def to_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The bottleneck (`kind`, one of VERDICTS), each candidate cost as a fraction of the step, the one or two
    changes predicted to help most, best first, and the kinds of work furthest from their bound
    (`bounds.far_from_bound`)."""

    kind: str
    fractions: dict
    advice: tuple[Advice, ...]
    far_from_bound: tuple[dict, ...] = ()

    def to_dict(self) -> dict:
        return {"kind": self.kind, "fractions": {k: round(v, 4) for k, v in self.fractions.items()},
                "advice": [a.to_dict() for a in self.advice],
                "far_from_bound": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in entry.items()}
                                   for entry in self.far_from_bound]}


def _advice(change: str, why: str, saved_ms: float, step_ms: float) -> Advice:
    saved = min(max(saved_ms, 0.0), step_ms * 0.999)
    predicted = step_ms - saved
    return Advice(change, why, saved, predicted, step_ms / predicted - 1.0)


def steps_per_execution_advice(b: ReplicaBreakdown, context: StepContext) -> Optional[Advice]:
    """`steps_per_execution=N` for the smallest N of STEPS_PER_EXECUTION_CHOICES (above the current one) that
    leaves at most REMAINING_GAP_FRACTION of the step in per-call gaps, and whose staged batches fit (compiled
    execution); None without a per-call gap."""
    if b.per_call_gap_ms <= 0:
        return None
    larger = [n for n in STEPS_PER_EXECUTION_CHOICES if n > context.steps_per_execution]
    memory_note = ""
    if context.compiled_execution and context.batch_bytes and context.device_free_bytes:
        fits = [n for n in larger
                if STAGED_BATCHES * n * context.batch_bytes <= STAGED_MEMORY_SHARE * context.device_free_bytes]
        if len(fits) < len(larger):
            memory_note = (f"; at most {fits[-1] if fits else context.steps_per_execution}: about "
                           f"{STAGED_BATCHES}N batches of {context.batch_bytes / 2**20:.1f} MiB are held per device")
        larger = fits
    if not larger:
        return None
    if context.compiled_execution:
        boundary = b.boundary_idle_ms or b.per_call_gap_ms
        copy = context.batch_bytes / (PINNED_COPY_GB_PER_S * 1e6) if context.batch_bytes else b.exposed_h2d_ms
        base = max(b.step_ms - boundary * b.calls_per_step - b.exposed_h2d_ms + copy, 1e-6)
        chosen = next((n for n in larger if boundary / n <= REMAINING_GAP_FRACTION * base), larger[-1])
        saved = b.step_ms - (base + boundary / chosen)
        how = (f"the N steps then run as one XLA program per replica: the {boundary:.2f} ms the GPU waits between "
               f"calls (the next batch, the next launch) is paid once per execution; the idle inside a step stays, "
               f"and the input copy, {copy:.2f} ms per step from pinned memory, still runs between executions")
    else:
        chosen = next((n for n in larger if b.per_call_gap_ms / n <= REMAINING_GAP_FRACTION * b.step_ms),
                      larger[-1])
        saved = (b.per_call_gap_ms * b.calls_per_step - b.per_call_gap_ms / chosen) * GAP_REMOVED_BY_MULTI_STEP
        how = "Keras' loop still launches each step"
    return _advice(f"steps_per_execution={chosen}",
                   f"each training-function call leaves the GPU idle {b.per_call_gap_ms:.2f} ms between calls; "
                   f"{chosen} steps per call pay the call's share of it once ({how}){memory_note}", saved, b.step_ms)


def input_advice(b: ReplicaBreakdown, context: StepContext) -> Optional[Advice]:
    """uint8 input (float32 input) or prefetching to the devices, from the exposed host-to-device copy."""
    if b.exposed_h2d_ms <= 0:
        return None
    if context.float_input:
        return _advice("send the input as uint8 and cast it on the GPU (keras.layers.Rescaling(1/255))",
                       f"{b.exposed_h2d_ms:.2f} ms of host-to-device copy per step is not hidden; uint8 moves a "
                       f"quarter of the float32 bytes", 0.75 * b.exposed_h2d_ms, b.step_ms)
    return _advice("prefetch 2 batches to each device: tf_nvlink.strategy(input_buffer=2)",
                   f"{b.exposed_h2d_ms:.2f} ms of host-to-device copy per step is not hidden behind compute",
                   b.exposed_h2d_ms, b.step_ms)


def allreduce_advice(b: ReplicaBreakdown, context: StepContext) -> list[Advice]:
    """bfloat16 all-reduce (float32 now) and XLA's latency-hiding scheduler, from the exposed collective."""
    if context.replicas < 2 or b.exposed_collective_ms <= 0:
        return []
    found = []
    if context.allreduce_dtype == "float32" and context.link is not None and context.gradient_bytes:
        # one call: the gradients are packed into one buffer (tf_nvlink's default num_packs=1)
        full = costmodel.allreduce_ms(context.gradient_bytes, context.link, context.replicas)
        half = costmodel.allreduce_ms(context.gradient_bytes / 2, context.link, context.replicas)
        share = (full - half) / full if full > 0 else 0.0
        found.append(_advice('tf_nvlink.strategy(allreduce_dtype="bfloat16")',
                             f"{b.exposed_collective_ms:.2f} ms of all-reduce per step is exposed; bfloat16 halves "
                             f"the {context.gradient_bytes / 2**20:.0f} MiB of gradients, {share:.0%} of the "
                             f"modelled all-reduce time on {context.link.name}",
                             share * b.exposed_collective_ms, b.step_ms))
    if LATENCY_HIDING_FLAG in context.xla_flags:
        return found
    found.append(_advice(f"XLA_FLAGS={LATENCY_HIDING_FLAG}",
                         f"the scheduler overlaps the all-reduce with the backward pass: it can hide at most the "
                         f"{b.exposed_collective_ms:.2f} ms exposed per step (an upper bound)",
                         b.exposed_collective_ms, b.step_ms))
    return found


def diagnose(b: ReplicaBreakdown, context: StepContext, bounds: Optional[dict] = None) -> Verdict:
    """The verdict and the (at most two) changes with the largest predicted gain, for the verdict's cost first; with
    the kinds' bounds (`bounds.kind_bounds`), the kinds of work furthest from them."""
    fractions = {"host-bound": b.idle_ms / b.step_ms, "input-bound": b.exposed_h2d_ms / b.step_ms,
                 "link-bound": b.exposed_collective_ms / b.step_ms}
    kind = max(fractions, key=fractions.get)
    if fractions[kind] < BOUND_FRACTION:
        kind = "compute-bound"
    fractions["compute-bound"] = b.compute_ms / b.step_ms
    by_cost = {"host-bound": [steps_per_execution_advice(b, context)],
               "input-bound": [input_advice(b, context)],
               "link-bound": allreduce_advice(b, context)}
    first = sorted((a for a in by_cost.get(kind, []) if a is not None), key=lambda a: -a.gain)
    rest = sorted((a for k, options in by_cost.items() if k != kind for a in options if a is not None),
                  key=lambda a: -a.gain)
    advice = (first + rest)[:2]
    far = work_bounds.far_from_bound(bounds, b.work_cost, b.step_ms, context.replicas)
    return Verdict(kind, fractions, tuple(a for a in advice if a.saved_ms > 0), tuple(far))
