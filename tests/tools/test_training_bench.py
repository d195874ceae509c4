"""The training benchmark (tf_nvlink/tools/training_bench: its candidates, runner and table, its worker, its models;
examples/benchmark.py) on logical CPU devices."""

import pytest

from conftest import run_python
from tf_nvlink.tools import bench_stats
from tf_nvlink.tools.training_bench import cli as training_bench
from tf_nvlink.tools import bench_models
from tf_nvlink.tools.training_bench import worker
from tf_nvlink.tools.training_bench.candidates import Candidate, parse_list


@pytest.mark.parametrize("text, expected", [
    ("1gpu,auto", ["1gpu", "auto"]),
    ("nccl@nop2p, auto@split", ["nccl@nop2p", "auto@split"]),
    ("auto@nop2p@fused", ["auto@fused@nop2p"]),  # modifiers in their fixed order: pairs match however typed
    ("workers,workers@nop2p", ["workers", "workers@nop2p"]),
    ("auto@nolhs,auto@bf16grad@nop2p,auto@buffer1", ["auto@nolhs", "auto@bf16grad@nop2p", "auto@buffer1"]),
    ("1gpu@ondevice,stock@ondevice,workers@ondevice", ["1gpu@ondevice", "stock@ondevice", "workers@ondevice"]),
    ("onedevice,auto@nocudagraphs,1gpu@nocudagraphs", ["onedevice", "auto@nocudagraphs", "1gpu@nocudagraphs"]),
])
def test_parse_candidates(text, expected):
    parsed = parse_list(text)
    assert [c.label for c in parsed] == expected
    assert [Candidate.parse(c.label) for c in parsed] == parsed  # labels round-trip


def test_candidate_fields_and_pairs():
    candidate = Candidate.parse("auto@nop2p@bf16grad@split")
    assert (candidate.base, candidate.xla_allreduce, candidate.bf16grad, candidate.nop2p, candidate.nolhs) == (
        "auto", "split", True, True, False)
    assert candidate.without("nop2p") == Candidate("auto", xla_allreduce="split", bf16grad=True)
    assert candidate.without("split").label == "auto@bf16grad@nop2p" and candidate.without("nosync") is candidate
    assert candidate.is_tf_nvlink_strategy and not candidate.one_device and candidate.needs_gpu
    assert Candidate.parse("onedevice").one_device and not Candidate.parse("collective@split").needs_gpu


@pytest.mark.parametrize("text, bad", [("gpu", "no base 'gpu'"), ("auto@fast", "no modifier '@fast'"),
                                       ("auto@split@fused", "'@split' and '@fused'"),
                                       ("auto@nop2p@nop2p", "'@nop2p' given twice"), ("auto@bf16", "'@bf16'")])
def test_parse_candidates_rejects_unknown_names_naming_the_bad_token_and_valid_ones(text, bad):
    with pytest.raises(ValueError, match=bad) as error:
        parse_list(text)
    assert "reduce_to_one" in str(error.value) and "'@nocudagraphs'" in str(error.value)
    with pytest.raises(ValueError, match="comma list"):
        parse_list(" , ")


@pytest.mark.parametrize("text", ["workers@split", "1gpu@fused", "stock@split", "1gpu@bf16grad", "stock@nolhs",
                                  "workers@buffer1", "onedevice@nosync"])
def test_strategy_options_only_for_tf_nvlink_single_process_strategies(text):
    with pytest.raises(ValueError, match="only '@nocudagraphs', '@ondevice', '@nop2p', '@customloop' apply"):
        parse_list(text)


def test_worker_environment_of_each_modifier():
    assert Candidate.parse("auto").worker_env({"XLA_FLAGS": "--xla_dump_to=/tmp/x"}) == {}
    assert Candidate.parse("auto@nosync@nop2p").worker_env({}) == {"NCCL_P2P_DISABLE": "1",
                                                                   "TF_NVLINK_SYNC_NON_TRAINABLE": "0"}
    # the user's XLA flags stay; the command-buffer flag comes last, so it wins over an earlier setting
    assert Candidate.parse("1gpu@nocudagraphs").worker_env({"XLA_FLAGS": "--xla_dump_to=/tmp/x"}) == {
        "XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_gpu_enable_command_buffer="}


def test_steady_state_splits_the_fixed_cost_of_a_fit_call():
    split = worker.steady_state(fit_s=1.5, long_fit_s=4.5, steps=10, long_steps=40)
    assert split == {"steady_step_s": pytest.approx(0.1), "fixed_s_per_fit": pytest.approx(0.5)}
    assert worker.steady_state(1.5, None, 10, 0) == {}
    with pytest.raises(ValueError, match="long_steps should be 0 .* more than steps=10"):
        training_bench.run_candidates("convnet", ["1gpu"], steps=10, long_steps=10)


def test_workers_candidate_needs_two_gpus_without_cpu_workers(monkeypatch):
    from tf_nvlink.machine import nvml
    from tf_nvlink.machine.topology import Topology

    assert training_bench.worker_layout(cpu_devices=3) == ["", "", ""]
    monkeypatch.setattr(nvml, "probe", lambda: Topology(error="NVML Shared Library Not Found"))
    with pytest.raises(ValueError, match="needs 2 or more GPUs.*--cpu_devices"):
        training_bench.worker_layout()


@pytest.mark.parametrize("jit", [pytest.param(False, marks=pytest.mark.slow), True], ids=["nojit", "jit"])
def test_workers_candidate_trains_on_two_cpu_workers_in_lockstep(jit):
    """Two MultiWorkerMirroredStrategy processes on localhost, started and reaped together. With XLA the
    gradients are compiled per worker and all-reduced outside XLA ("split"): XLA's own all-reduce cannot span
    processes (it failed on 2x H200)."""
    records = training_bench.run_candidates("convnet", ["workers"], steps=2, jit=jit, cpu_devices=2, timeout=240,
                                            rounds=1, warmup_steps=1)
    record = records[0]
    assert "error" not in record, record.get("error")
    assert record["workers"] == 2 and record["replicas"] == 2 and len(record["worker_step_ms"]) == 2
    assert record["examples_per_s"] > 0 and "MultiWorkerMirroredStrategy, 2 workers" in record["plan"]
    assert record["jit_compile"] is jit and record["xla_allreduce"] == ("split" if jit else None)


def test_table_shows_measured_nvlink_bytes_beside_the_expected_ones():
    """Issue 17: each candidate's NVLink bytes per step (NVLinkMonitor in the worker) beside the all-reduce's."""
    rows = [
        {"candidate": "1gpu", "replicas": 1, "jit_compile": True, "step_ms": 30.0, "examples_per_s": 4200.0,
         "nvlink_bytes_per_step": None, "nvlink_expected_bytes_per_step": None,
         "nvlink_unavailable": "one replica (no multi-GPU strategy): nothing is all-reduced over NVLink"},
        {"candidate": "auto", "replicas": 2, "jit_compile": True, "step_ms": 36.0, "examples_per_s": 7100.0,
         "nvlink_bytes_per_step": 98.0 * 2**20, "nvlink_expected_bytes_per_step": 97.6 * 2**20},
        {"candidate": "auto@nop2p", "replicas": 2, "jit_compile": True, "step_ms": 40.0, "examples_per_s": 6400.0,
         "nvlink_bytes_per_step": 0.0, "nvlink_expected_bytes_per_step": 97.6 * 2**20},
        {"candidate": "collective", "replicas": 2, "jit_compile": True, "step_ms": 40.0, "examples_per_s": 6400.0,
         "nvlink_bytes_per_step": None, "nvlink_unavailable": "GPU 0: no NVLink"},
    ]
    lines = training_bench.render_table(rows).splitlines()
    assert lines[0].split()[-1] == "NVLink/expected" and lines[1].split()[-1] == "(MiB/step/GPU)"
    cells = {line.split()[0]: line.split()[-1] for line in lines[2:6]}
    assert cells == {"1gpu": "n/a", "auto": "98.0/97.6", "auto@nop2p": "0.0/97.6", "collective": "n/a"}
    footer = next(line for line in lines if line.startswith("# NVLink/expected"))
    assert footer.endswith("; n/a: collective: GPU 0: no NVLink")  # one replica needs no reason


def test_table_ratios_scaling_and_nvlink_speedup():
    rows = [
        {"candidate": "1gpu", "replicas": 1, "jit_compile": True, "step_ms": 40.0, "examples_per_s": 3200.0},
        {"candidate": "stock", "replicas": 2, "jit_compile": False, "step_ms": 200.0, "examples_per_s": 1280.0},
        {"candidate": "auto", "replicas": 2, "jit_compile": True, "step_ms": 44.0, "examples_per_s": 5760.0,
         "plan": "tf_nvlink plan: X"},
        {"candidate": "auto@nop2p", "replicas": 2, "jit_compile": True, "step_ms": 50.0, "examples_per_s": 4800.0},
        {"candidate": "nccl", "error": "boom"},
    ]
    table = training_bench.render_table(rows)
    auto_row = next(line for line in table.splitlines() if line.startswith("auto "))
    assert auto_row.split()[-3:] == ["1.80", "0.90", "4.50"]  # vs 1 GPU, scaling, vs stock
    assert "NVLink speed-up for auto: 1.20x" in table
    assert "nccl" in table and "FAILED: boom" in table and "# tf_nvlink plan: X" in table
    assert "run-to-run noise" not in table


def test_table_gives_the_cost_of_the_batch_norm_statistics_sync():
    rows = [{"candidate": name, "replicas": 2, "jit_compile": True, "step_ms": 3.0, "examples_per_s": eps}
            for name, eps in (("auto@fused", 990.0), ("auto@fused@nosync", 1000.0))]
    assert "BatchNorm-statistics sync costs auto@fused 1.0% (990 vs 1000 examples/s without it)" in (
        training_bench.render_table(rows))


def test_table_says_ops_do_not_matter_under_fused_xla():
    rows = [{"candidate": name, "replicas": 2, "jit_compile": True, "step_ms": 3.0, "examples_per_s": eps,
             "xla_allreduce": "fused"} for name, eps in (("auto", 690e3), ("hierarchical", 868e3))]
    rows.append({"candidate": "nccl@split", "replicas": 2, "jit_compile": True, "step_ms": 3.0,
                 "examples_per_s": 600e3, "xla_allreduce": "split"})
    line = next(x for x in training_bench.render_table(rows).splitlines() if "noise" in x)
    assert line.startswith("# auto, hierarchical: the all-reduce ran inside XLA") and "nccl@split" not in line


@pytest.mark.slow  # a faster test covers the substance; CI runs the slow tier
def test_benchmark_example_runs_candidates_in_their_own_processes(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_python(["examples/benchmark.py", "--model", "convnet", "--candidates", "1gpu,auto",
                       "--cpu_devices", "2", "--steps", "2", "--json", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "examples/s" in proc.stdout and "# tf_nvlink plan: CPU" in proc.stdout
    import json

    records = json.loads(out.read_text())
    assert [r["candidate"] for r in records] == ["1gpu", "auto"]
    assert records[1]["replicas"] == 2 and records[1]["jit_compile"] and records[0]["examples_per_s"] > 0


def test_benchmark_example_rejects_bad_candidates():
    proc = run_python(["examples/benchmark.py", "--candidates", "warp_drive"], timeout=120)
    assert proc.returncode != 0 and "Unknown candidate 'warp_drive'" in proc.stderr


def test_rounds_report_the_median_round_and_the_spread():
    rounds = [{"candidate": "auto", "examples_per_s": eps, "step_ms": 1.0} for eps in (700.0, 600.0, 800.0)]
    combined = training_bench.combine_rounds(rounds)
    assert combined["examples_per_s"] == 700.0 and combined["rounds_examples_per_s"] == [700.0, 600.0, 800.0]
    assert combined["spread"] == pytest.approx(200 / 700, abs=1e-4)
    partly = training_bench.combine_rounds([{"candidate": "auto", "error": "boom"}, rounds[1], rounds[2]])
    assert partly["examples_per_s"] == 600.0 and partly["failed_rounds"] == ["boom"]  # lower middle of 2
    assert "error" in training_bench.combine_rounds([{"candidate": "x", "error": "a"}, {"candidate": "x",
                                                                                         "error": "b"}])
    assert training_bench.combine_rounds(rounds[:1]) == rounds[0]


@pytest.mark.slow  # two rounds of real runs; combine_rounds is tested above without training
def test_two_interleaved_rounds_on_cpu_with_the_steady_state_split(capsys):
    records = training_bench.run_candidates("convnet", ["1gpu", "auto"], steps=2, jit=False, cpu_devices=2,
                                            rounds=2, timeout=240, warmup_steps=1, long_steps=12)
    assert [len(r["rounds_examples_per_s"]) for r in records] == [2, 2]
    order = [line.split(":")[0].strip() for line in capsys.readouterr().err.splitlines() if "round" in line]
    assert order == ["1gpu (round 1/2)", "auto (round 1/2)", "auto (round 2/2)", "1gpu (round 2/2)"]
    assert all(r["long_steps"] == 12 and "fixed_s_per_fit" in r and "steady_step_s" in r for r in records)
    table = training_bench.render_table(records)
    assert "spread" in table and "2 rounds, candidates interleaved (even rounds in reverse order)" in table
    if all("steady_examples_per_s" in r for r in records):  # a noisy machine can make the difference negative
        assert "steady state (12-step fit minus 2-step fit, same process)" in table
    with pytest.raises(ValueError, match="rounds should be a positive integer"):
        training_bench.run_candidates("convnet", ["1gpu"], rounds=0)


def test_median_round_spread_and_the_overlap_warning():
    stats = bench_stats.summarize([700.0, None, 600.0, 800.0])
    assert (stats.median, stats.low, stats.high, stats.rounds) == (700.0, 600.0, 800.0, 3)
    assert stats.spread == pytest.approx(200 / 700, abs=1e-4) and stats.describe() == "700 (600..800, spread 28.6%)"
    assert bench_stats.summarize([2.0, 1.0]).median == 1.0  # the lower middle: a round that ran
    with pytest.raises(ValueError, match="at least one measured round"):
        bench_stats.summarize([None])
    apart = {"a": bench_stats.summarize([100.0, 101.0]), "b": bench_stats.summarize([110.0, 111.0])}
    assert bench_stats.overlap_warning(apart) is None
    close = dict(apart, c=bench_stats.summarize([100.5, 103.0]))
    assert bench_stats.overlap_warning(close).startswith(
        "rounds disagree more than the medians differ: c (100..103) and a (100..101) overlap")


def test_table_warns_when_rounds_overlap_and_scales_against_the_best_one_device_setup():
    def row(name, rounds, replicas=1):
        return {"candidate": name, "replicas": replicas, "jit_compile": True, "step_ms": 1.0,
                "examples_per_s": sorted(rounds)[1], "rounds_examples_per_s": rounds, "spread": 0.01,
                "steady_examples_per_s": 2 * sorted(rounds)[1], "steady_step_s": 0.001, "fixed_s_per_fit": 0.2,
                "steps": 10, "long_steps": 40}

    rows = [row("1gpu", [1000.0, 1010.0, 1020.0]), row("onedevice", [1015.0, 1030.0, 1040.0]),
            row("auto", [1800.0, 1900.0, 1850.0], replicas=2)]
    lines = training_bench.render_table(rows).splitlines()
    assert "# warning: rounds disagree more than the medians differ: onedevice (1015..1040) and 1gpu " \
           "(1000..1020) overlap; more rounds or steps would settle their order" in lines
    assert "# scaling against the best one-device setup (onedevice, whole fits): auto 0.90" in lines
    assert "# scaling against the best one-device setup (onedevice, steady state): auto 0.90" in lines
    steady = lines[lines.index("steady state (40-step fit minus 10-step fit, same process)") + 2:][:3]
    assert [line.split()[0] for line in steady] == ["1gpu", "onedevice", "auto"]
    assert steady[2].split()[-3:] == ["1.83", "0.92", "200"]  # vs 1gpu, scaling, fixed ms per fit


def test_host_batches_come_in_the_dtypes_users_feed():
    images, labels = bench_models.synthetic_batch("convnet", 6)
    assert images.dtype == "uint8" and images.shape == (6, 16, 16, 3) and labels.dtype == "int32"
    tokens, targets = bench_models.synthetic_batch("transformer_tiny", 3)
    assert tokens.dtype == targets.dtype == "int32" and tokens.shape == targets.shape == (3, 16)
    assert (tokens[:, 1:] == targets[:, :-1]).all()  # next-token targets
    features, _ = bench_models.synthetic_batch("mlp", 2)
    assert features.dtype == "float32" and features.shape == (2, 784)
    big = bench_models.TRANSFORMER_CONFIGS["transformer"]
    assert (big["d_model"], big["num_layers"], big["num_heads"], big["seq_len"]) == (1024, 24, 16, 512)


def test_transformer_flops_count_the_non_embedding_weights_and_the_whole_attention_matrix(tf):
    """6·N·T + 12·L·D·S·T with N the parameters outside the embedding tables: N is what the Keras model trains less
    its token and position tables, and the two configs of the issue's figures give
    8.854 TFLOP (8 x 512 tokens) and 10.710 TFLOP (2 x 2048) a step."""
    import keras

    config = bench_models.TRANSFORMER_CONFIGS["transformer_tiny"]
    counted = bench_models.transformer_parameters(**config)
    built = bench_models.bench_body("transformer_tiny", keras)
    assert counted["non_embedding"] == built.count_params() - (config["vocab_size"] + config["seq_len"]) * config[
        "d_model"]
    assert counted["embedding"] == (config["vocab_size"] + config["seq_len"]) * config["d_model"]
    tokens = 3 * config["seq_len"]
    assert bench_models.transformer_flops_per_step("transformer_tiny", 3) == \
        6 * counted["non_embedding"] * tokens + 12 * 2 * 32 * 16 * tokens
    big = bench_models.transformer_parameters(**bench_models.TRANSFORMER_CONFIGS["transformer"])
    assert big["non_embedding"] + big["embedding"] == 368_403_712  # the "368M" model
    assert bench_models.transformer_flops_per_step("transformer", 8) == pytest.approx(8.854e12, rel=1e-4)
    assert bench_models.transformer_flops_per_step("transformer_2048", 2) == pytest.approx(10.710e12, rel=1e-4)
    assert bench_models.model_flops_per_step("transformer", 16) == 2 * bench_models.model_flops_per_step(
        "transformer", 8)
    assert bench_models.model_flops_per_step("resnet50", 128) is None


@pytest.mark.parametrize("name, batch, message", [
    ("resnet50", 8, "model should be one of ['transformer', 'transformer_2048', 'transformer_tiny']. Received: "
                    "'resnet50'"),
    ("transformer", 0, "global_batch should be a positive integer. Received: 0"),
    ("transformer", 2.0, "global_batch should be a positive integer. Received: 2.0"),
])
def test_transformer_flops_refuse_bad_input(name, batch, message):
    with pytest.raises(ValueError) as raised:
        bench_models.transformer_flops_per_step(name, batch)
    assert str(raised.value) == message


def test_the_2048_token_config_is_the_same_model_on_longer_sequences():
    short, long = (bench_models.TRANSFORMER_CONFIGS[n] for n in ("transformer", "transformer_2048"))
    assert long == {**short, "seq_len": 2048}
    tokens, targets = bench_models.synthetic_batch("transformer_2048", 2)
    assert tokens.shape == targets.shape == (2, 2048) and tokens.max() < short["vocab_size"]


@pytest.mark.parametrize("name", ["convnet", "transformer_tiny"])
def test_device_fed_model_computes_what_the_host_fed_model_does(tf, name):
    """`--input device` gathers the examples from a copy held in the model: same outputs as feeding them."""
    import keras
    import numpy as np

    x, _ = bench_models.synthetic_batch(name, 4)
    keras.utils.set_random_seed(1)
    host = bench_models.build_bench_model(name, x, keras, "host")
    keras.utils.set_random_seed(1)  # the same initial weights
    device = bench_models.build_bench_model(name, x, keras, "device")
    order = np.array([2, 0, 3, 1], dtype="int32")
    np.testing.assert_allclose(device.predict(order, verbose=0), host.predict(x[order], verbose=0), rtol=1e-5)
    assert len(device.trainable_variables) == len(host.trainable_variables)  # the held batch is not trained
    assert host.inputs[0].dtype == x.dtype and device.inputs[0].dtype == "int32"
    held = [w for w in device.non_trainable_weights if "device_batch" in w.path][0]
    assert held.dtype == ("int64" if x.dtype == "int32" else str(x.dtype))  # int32 variables live on the host
    with pytest.raises(ValueError, match="input should be one of \\['host', 'device'\\]"):
        bench_models.build_bench_model(name, x, keras, "disk")


@pytest.mark.parametrize("model, candidates", [
    ("mlp", ["auto@bf16grad"]),
    # covered by [mlp-candidates0] and test_worker_environment_of_each_modifier; here: each worker's own XLA_FLAGS
    pytest.param("mlp", ["1gpu@nocudagraphs", "auto@bf16grad"], marks=pytest.mark.slow),
    pytest.param("transformer_tiny", ["auto", "auto@ondevice"], marks=pytest.mark.slow),  # trains longest
])
def test_bench_workers_train_on_two_cpu_replicas(model, candidates, tmp_path):
    profile = str(tmp_path / "profile") if model == "mlp" else ""
    records = training_bench.run_candidates(model, candidates, steps=2, warmup_steps=1, cpu_devices=2, rounds=1,
                                            timeout=240, profile_dir=profile, profile_steps=2)
    assert [r.get("error") for r in records] == [None] * len(candidates)
    assert [r["candidate"] for r in records] == candidates and all(r["examples_per_s"] > 0 for r in records)
    assert records[-1]["replicas"] == 2 and records[-1]["jit_compile"] and records[-1]["xla_allreduce"] == "split"
    if model == "mlp":
        if len(records) == 2:  # 1gpu@nocudagraphs: its worker alone has the command-buffer flag
            assert records[0]["replicas"] == 1 and records[0]["input"] == "host"
            assert records[0]["xla_flags_env"].endswith("--xla_gpu_enable_command_buffer=")
        assert records[-1]["xla_flags_env"] is None or "command_buffer" not in records[-1]["xla_flags_env"]
        assert records[-1]["allreduce_dtype"] == "bfloat16" and "all-reduced in bfloat16" in records[-1]["plan"]
        traced = records[-1]["profile"]
        assert traced["logdir"] == str(tmp_path / "profile" / "auto_bf16grad")  # the step doctor's window
        assert "GPU" in traced["unavailable"] and traced["verdict"] is None  # CPU replicas: no GPU plane, said so
        assert list((tmp_path / "profile" / "auto_bf16grad" / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
    else:
        assert [r["input"] for r in records] == ["host", "device"]
        assert records[0]["tokens_per_s"] == pytest.approx(16 * records[0]["examples_per_s"])
        counted = bench_models.transformer_parameters(**bench_models.TRANSFORMER_CONFIGS["transformer_tiny"])
        assert counted == {"embedding": (64 + 16) * 32, "non_embedding": 19264}  # token and trained position tables
        assert records[0]["parameters"] == records[1]["parameters"] == sum(counted.values()) == 21824
        assert "tokens/s" in training_bench.render_table(records)


@pytest.mark.slow  # a faster test covers the substance; CI runs the slow tier
def test_custom_loop_candidate_trains_two_cpu_replicas_with_an_xla_step():
    """@customloop: TensorFlow's custom-training-guide loop (strategy.run of a jit_compile step) instead of fit."""
    record = training_bench.run_candidates("convnet", ["auto@customloop"], steps=2, warmup_steps=1, cpu_devices=2,
                                           rounds=1, timeout=240)[0]
    assert "error" not in record, record.get("error")
    assert record["training_loop"] == "custom" and record["replicas"] == 2 and record["examples_per_s"] > 0
    assert record["nvlink_unavailable"] == "custom loop: NVLinkMonitor is a model.fit callback"
    assert "@customloop rows time the custom loop's steps" in training_bench.render_table([record])
    with pytest.raises(ValueError, match="'@customloop' runs in one process"):
        Candidate.parse("workers@customloop")


def test_table_step_option_ratios_and_scaling_per_input():
    def row(name, eps, replicas=2, input_mode="host"):
        return {"candidate": name, "replicas": replicas, "jit_compile": True, "step_ms": 1.0, "examples_per_s": eps,
                "input": input_mode, "spread": 0.05}

    rows = [row("1gpu", 1000.0, 1), row("1gpu@ondevice", 1100.0, 1, "device"), row("auto", 1800.0),
            row("auto@nolhs", 1700.0), row("auto@bf16grad", 1890.0), row("auto@buffer1", 1800.0),
            row("auto@ondevice", 2090.0, input_mode="device"), row("auto@nop2p", 1500.0),
            row("auto@bf16grad@nop2p", 1650.0)]
    table = training_bench.render_table(rows)
    lines = table.splitlines()
    assert next(x for x in lines if x.startswith("auto@ondevice ")).split()[-4:-1] == ["1.90", "0.95", "N/A"]
    assert next(x for x in lines if x.startswith("auto ")).split()[-4:-1] == ["1.80", "0.90", "N/A"]
    assert "# latency-hiding scheduler on/off for auto: 1.059x (auto 1800 vs auto@nolhs 1700 examples/s)" in lines
    assert "# bfloat16/float32 gradient all-reduce for auto: 1.050x (auto@bf16grad 1890 vs auto 1800 examples/s)" \
        in lines
    assert "# bfloat16/float32 gradient all-reduce for auto@nop2p: 1.100x (auto@bf16grad@nop2p 1650 vs auto@nop2p " \
           "1500 examples/s)" in lines
    assert "# plan's input buffer/buffer 1 for auto: 1.000x (auto 1800 vs auto@buffer1 1800 examples/s)" in lines
    assert any(x.startswith("# data on the device/host-fed for auto: 1.161x") for x in lines)
    assert any(x.startswith("# NVLink speed-up for auto: 1.20x") for x in lines)
    assert any(x.startswith("# NVLink speed-up for auto@bf16grad: 1.15x") for x in lines)
