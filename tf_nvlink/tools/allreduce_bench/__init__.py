"""`tf-nvlink bench`: all-reduce bandwidth through tf.distribute, per cross-device-ops candidate, nccl-tests style.

Every candidate runs in its own process (`python -m tf_nvlink.tools.allreduce_bench.worker ...`, which prints one JSON line),
because TensorFlow tolerates one MirroredStrategy per process. Inside a worker, for each size:

- each replica holds a float32 buffer filled with `replica_id + 1`;
- ONE tf.function runs `iters` all-reduces unrolled in Python, each through
  `tf.distribute.get_replica_context().merge_call` + `strategy.extended.batch_reduce_to` (what Keras optimizers
  do), each feeding the next so they serialise, and returns one scalar per replica (returning the buffer would
  time a device-to-host copy instead of the link);
- each all-reduce's input is a fresh buffer made on its replica's device: `x = tf.maximum(reduced, floor)`, with
  `floor` a per-replica -inf passed as a tf.function argument (a runtime value, so Grappler cannot fold it; max
  with -inf changes nothing, so the sums stay exact). Without it Grappler sees through the chain: for
  reduce_to_one the ArithmeticOptimizer merges the chained AddNs through the broadcast identities (on 2 logical
  CPU devices the whole chain became ONE AddN on the first device, its result sent once), so after the first
  all-reduce no data crossed between devices. That fits reduce_to_one's "483 GB/s" busbw on 2x H200 without the
  fix, above the 394 GB/s a GPU-to-GPU copy reaches (the GPU graph itself was not inspected); hierarchical, built
  from the same adds and identity copies, is probably exposed the same way; NCCL and collective ops are not.
  `tf.maximum` rather than `+ 0.0`: Grappler's AddOpsRewrite merges chained adds too (a chain of `x + d` became
  `x + 4*d`). With the fix, the partitioned graph of reduce_to_one over 2 devices holds one buffer transfer each
  way per all-reduce (`python -m tf_nvlink.tools.allreduce_bench.worker --inspect --candidate reduce_to_one
  --target cpu:2 --sizes 1K --iters 4` prints the counts; tests/tools/test_allreduce_bench.py checks them);
- the local work this adds (one elementwise max over the buffer per replica per all-reduce, ~2x buffer bytes of
  memory traffic) is timed in the same worker by the same chain with the all-reduce left out, minus the same
  call with no op at all (so the per-call overhead, dispatch and host read, stays in the figures as before), and
  subtracted: time = chained time - local time, but never below (1 - MAX_LOCAL_SHARE) of the chained time (at
  tiny sizes per-op overhead dominates and the difference is noise); the tables' footers list what was
  subtracted and where the cap applied, the JSON records carry raw_time_us, local_us and local_capped;
- for each function, `warmup` calls first (the first traces), then `repeats` timed calls, each ended by a tiny
  host read; chained time = wall time / (repeats * iters); local time = (local chain's wall time - the empty
  call's) / (repeats * iters);
- after the timed loop, one more all-reduce of the same buffers is checked on the device: every element must be
  n(n+1)/2 exactly; #wrong counts the elements that are not (summed over replicas).

algbw = bytes / time; busbw = algbw * 2(n-1)/n (nccl-tests' all-reduce factor), in GB/s (1e9 bytes/s).

Candidates: "collective" (TensorFlow's default CollectiveAllReduce), "nccl[:PACKS]" (NcclAllReduce packing the
buffer into PACKS all-reduces), "hierarchical[:PACKS]" (GPUs, even count only), "reduce_to_one", "auto"
(what tf_nvlink.strategy() picks, shown with what it resolved to), and "xla" (GPUs only: the chain is one
jit_compile=True function per replica and each all-reduce is `replica_ctx.all_reduce`, which TensorFlow compiles
into the XLA program without merge_call; this is how jit_compile=True models all-reduce in tf_nvlink's fused mode,
where the plan's cross-device ops are not used). `--devices cpu:N` runs over N logical CPU
devices (tests, machines without GPUs), where the GPU-only candidates are skipped with the reason.

Example:
    $ tf-nvlink bench --sizes 16M,256M --candidates nccl:1,collective,auto --json bench.json
    $ tf-nvlink bench --compare_p2p --candidates nccl:1      # NVLink on vs NCCL_P2P_DISABLE=1
    $ python -m tf_nvlink.tools.allreduce_bench --devices cpu:2 --sizes 1K,64K --iters 2

Modules: `specs` (sizes, candidates, target, maths), `worker` (TensorFlow, one candidate per process, its own
entry point), `runner` (spawns the workers, makes records), `render` (tables, plot), `cli` (options, `run`).
`import tf_nvlink.tools.allreduce_bench` does not import TensorFlow; only the workers do.
"""
