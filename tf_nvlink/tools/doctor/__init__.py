"""The step doctor: why doesn't my training scale? A profiled window of a real `fit`, read into the step's
breakdown per replica, a verdict with the changes that help most and their predicted gains, scaling predictions
and what NVLink buys.

- `trace`: reading the profiler's `.xplane.pb` (GPU activity by kind, copies by the trace's own kind and memory);
- `work_kinds` and `hlo_cost`: each kernel's kind of work (matmul, normalisation, ...) and what its HLO instruction
  reads, writes and computes;
- `bounds`: each kind of work against the time its bytes and FLOPs take at the GPU's bandwidth and peak;
- `breakdown`: compute, exposed/hidden all-reduce, input copies, idle, per-call gap (ms per step);
- `verdict`: host-, input-, link- or compute-bound, and the advice with its predicted gain;
- `predictions`: scaling on 2/4/8 GPUs and the step without NVLink (from `tf_nvlink.tools.costmodel`);
- `diagnosis`: trace -> report dict; `outputs`: table, JSON, PNG, TensorBoard summaries (scalars, text, image);
- `callback`: `StepDoctor`, the Keras callback (also `tf_nvlink.StepDoctor`);
- `bench` and `command`: `tf-nvlink doctor` (also `python -m tf_nvlink.tools.doctor`) on a benchmark model.
- `reread`: a saved run (step_doctor.json and its trace) read again by the current doctor (`tf-nvlink doctor
  --reread`).

Example:
    >>> model.fit(data, epochs=1, steps_per_epoch=2000, callbacks=[tf_nvlink.StepDoctor()])
"""
