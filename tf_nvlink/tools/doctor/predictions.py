"""What the measured window predicts elsewhere: scaling on 2, 4 and 8 GPUs, and what NVLink buys.

Both use `tf_nvlink.tools.costmodel`, calibrated by the window: one GPU's step is the measured step minus its
exposed all-reduce (and, measured on N replicas, the N - 1 replicas' modelled overhead), the gradient bytes are
the model's. "Without NVLink" sends the same bytes over the host path
NCCL takes with `NCCL_P2P_DISABLE=1` (costmodel's "pcie-host", measured on 2x H200): the all-reduce's measured
time grows by the modelled difference, the part of it that compute hid stays hidden, and the step grows by the rest.

Example:
    >>> nvlink_answer(mean, context, measured_bytes_per_step=1.02e8)["speedup_from_nvlink"]
    1.12
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tf_nvlink.tools import costmodel
from tf_nvlink.tools.doctor.breakdown import ReplicaBreakdown
from tf_nvlink.tools.doctor.verdict import StepContext

SCALING_GPUS = (2, 4, 8)
COMPARED_LINKS = ("nvswitch-h200", "pcie-gen5", "pcie-gen4", "pcie-host")
NO_NVLINK_LINK = "pcie-host"
NVLINK_KINDS = ("nvswitch", "nvlink-all", "nvlink-partial")


def _workload(b: ReplicaBreakdown, context: StepContext,
              replica_overhead_ms: float = costmodel.REPLICA_OVERHEAD_HOST_FED_MS) -> costmodel.Workload:
    """One GPU's step as the cost model takes it: the measured step less its exposed all-reduce and, measured on N
    replicas, less the N - 1 replicas' modelled overhead (never below the kernels' own time)."""
    one_gpu_ms = b.step_ms - b.exposed_collective_ms - (context.replicas - 1) * replica_overhead_ms
    return costmodel.Workload(compute_ms=max(one_gpu_ms, b.compute_ms, 1e-6),
                              gradient_bytes=int(context.gradient_bytes),
                              gradient_tensors=max(int(context.gradient_tensors), 1),
                              per_gpu_batch=max(int(context.per_replica_batch), 1), name="measured")


def scaling(b: ReplicaBreakdown, context: StepContext,
            replica_overhead_ms: float = costmodel.REPLICA_OVERHEAD_HOST_FED_MS) -> list[dict]:
    """Predicted step, scaling and samples/s on 2, 4 and 8 GPUs of this machine's links (when it has 2+ GPUs;
    more GPUs than it has are assumed joined the same way) and of the COMPARED_LINKS machines.

    replica_overhead_ms: per-step cost of each extra replica (default: the host-fed figure measured on 2x H200).
    """
    workload = _workload(b, context, replica_overhead_ms)
    links = {name: costmodel.LINKS[name] for name in COMPARED_LINKS}
    if context.link is not None:
        links = {"this machine": dataclasses.replace(context.link, max_gpus=max(SCALING_GPUS)), **links}
    rows = []
    for label, link in links.items():
        for n in SCALING_GPUS:
            p = costmodel.predict(workload, link, n, allreduce_dtype=context.allreduce_dtype,
                                  replica_overhead_ms=replica_overhead_ms)
            rows.append({"machine": label, "link": link.name, "gpus": n, "step_ms": round(p.step_ms, 3),
                         "allreduce_ms": round(p.comm_ms, 3), "scaling": round(p.scaling, 3),
                         "samples_per_s": round(p.samples_per_s, 1) if context.per_replica_batch else None})
    return rows


def nvlink_answer(b: ReplicaBreakdown, context: StepContext,
                  measured_bytes_per_step: Optional[float] = None) -> dict:
    """"How much faster is my training because of NVLink?" from the window: the all-reduce's measured time and
    bytes, the time the same bytes take over the host path, and the predicted step and speed-up without NVLink.
    With one replica there is no all-reduce: the answer says so and predicts 2 GPUs of this machine's links
    (or of an NVSwitch H200 machine when it has one GPU). With a link that is not NVLink (a PCIe machine) the
    answer says NVLink buys nothing."""
    no_nvlink = costmodel.LINKS[NO_NVLINK_LINK]
    modelled_bytes = costmodel.ALLREDUCE_BYTES_PER_ELEMENT[context.allreduce_dtype] * context.gradient_bytes / 4
    if context.replicas < 2:
        link = context.link or costmodel.LINKS["nvswitch-h200"]
        workload = _workload(b, context)
        with_nvlink = costmodel.predict(workload, link, 2, allreduce_dtype=context.allreduce_dtype)
        without = costmodel.predict(workload, no_nvlink, 2, allreduce_dtype=context.allreduce_dtype)
        return {"answer": f"one replica: nothing is all-reduced, so NVLink carries nothing; predicted for 2 GPUs "
                          f"({link.name} against {no_nvlink.name})",
                "gpus": 2, "nvlink_link": link.name, "step_ms_with_nvlink": round(with_nvlink.step_ms, 3),
                "step_ms_without_nvlink": round(without.step_ms, 3),
                "speedup_from_nvlink": round(without.step_ms / with_nvlink.step_ms, 3)}
    if context.machine_kind not in NVLINK_KINDS:
        return {"answer": f"these GPUs are joined by {context.machine_kind}, not NVLink: NVLink buys nothing here",
                "gpus": context.replicas, "speedup_from_nvlink": 1.0}
    link = context.link or costmodel.LINKS["nvswitch-h200"]
    n = context.replicas
    modelled_nvlink = costmodel.allreduce_ms(modelled_bytes, link, n)
    modelled_without = costmodel.allreduce_ms(modelled_bytes, no_nvlink, n)
    collective_without = b.collective_ms + (modelled_without - modelled_nvlink)
    exposed_without = max(collective_without - b.hidden_collective_ms, 0.0)
    step_without = b.step_ms - b.exposed_collective_ms + exposed_without
    return {"answer": f"NVLink makes each step {step_without / b.step_ms:.2f}x faster than the host path would",
            "gpus": n, "nvlink_link": link.name, "no_nvlink_link": no_nvlink.name,
            "allreduce_ms_measured": round(b.collective_ms, 3),
            "allreduce_bytes_per_step_measured": measured_bytes_per_step,
            "allreduce_bytes_per_step_modelled": round(modelled_bytes * 2 * (n - 1) / n),
            "allreduce_ms_modelled_nvlink": round(modelled_nvlink, 3),
            "allreduce_ms_without_nvlink": round(collective_without, 3),
            "step_ms_with_nvlink": round(b.step_ms, 3), "step_ms_without_nvlink": round(step_without, 3),
            "speedup_from_nvlink": round(step_without / b.step_ms, 3),
            "check": "compare with a run under NCCL_P2P_DISABLE=1"}
