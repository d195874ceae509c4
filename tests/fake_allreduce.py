"""A stand-in for the all-reduce benchmark's measurement (`runner.measure`), for the tests of `tf-nvlink bench`
and `tf-nvlink tune` that check what happens around a measurement, without worker processes."""

from tf_nvlink.tools.allreduce_bench import runner, specs

# A one-candidate, one-size request on 2 logical CPU devices.
BENCH_ARGS = ["--devices", "cpu:2", "--candidates", "reduce_to_one", "--sizes", "1K", "--iters", "1"]


def fake_measure(calls, before_return=None):
    """runner.measure's stand-in: one correct reduce_to_one record per size; records each call's sizes in
    `calls` and runs `before_return()` (e.g. breaking the output folder) before returning."""
    def measure(candidates, target, sizes, **_):
        calls.append(list(sizes))
        if before_return:
            before_return()
        output = {"ok": True, "ops": "reduce_to_one", "n_replicas": target.n, "tf_version": "2.21.0",
                  "results": [{"size_bytes": s, "count": s // 4, "time_us": 100.0, "wrong": 0} for s in sizes]}
        return runner.to_records(output, specs.parse_candidate("reduce_to_one"), target), []
    return measure
