"""tf_nvlink.distribute.multi_worker: TF_CONFIG validation, the collective implementation per topology, waiting for peers,
and two real worker processes training the MLP together on localhost (CPU)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from fake_nvml import FakeNvml, dgx1_v100_x8, h200_x2, no_driver, pcie_x4

from conftest import ROOT
from tf_nvlink.distribute import multi_worker
from tf_nvlink.machine import nvml
from tf_nvlink.plan import policy
from tf_nvlink.util import json_workers as worker_processes
from tf_nvlink.distribute import rendezvous
from tf_nvlink.distribute.multi_worker import MultiWorkerPlan, WorkerInfo
from tf_nvlink.machine import cluster_config
from tf_nvlink.machine.cluster_config import ClusterConfig, TfConfigError
from tf_nvlink.machine.topology import Topology

EXAMPLE = str(ROOT / "examples" / "multi_worker.py")
TWO = ["localhost:2222", "localhost:2223"]


def tf_config(cluster=None, task_type="worker", index=0, **extra):
    return json.dumps({"cluster": {"worker": TWO} if cluster is None else cluster,
                       "task": {"type": task_type, "index": index}, **extra})


def free_ports(n):
    """n distinct ports nothing listens on (bound to port 0 together, then released)."""
    return worker_processes.free_ports(n, host="127.0.0.1")


# ---- TF_CONFIG ---------------------------------------------------------------------------------------------

BAD_TF_CONFIGS = [
    ("worker:0", r"TF_CONFIG is not valid JSON: Expecting value at line 1 column 1"),
    ('{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}',
     r"not valid JSON: Expecting ',' delimiter"),
    ('{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": NaN}}',
     r"contains NaN, which is not JSON"),
    ('{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": -Infinity}}',
     r"contains -Infinity, which is not JSON"),
    ('{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0, "index": 1}}',
     r"names the key 'index' twice"),
    ('{"cluster": {"worker": ["a:1"]}, "cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker"}}',
     r"names the key 'cluster' twice"),
    ('["a:1", "b:1"]', r"should be a JSON object such as .*; got a JSON array"),
    ('"worker"', r"should be a JSON object .*; got a JSON string"),
    ("null", r"got a JSON null"),
    ('{"task": {"type": "worker", "index": 0}}', r'has no "cluster".*Received keys: \[\'task\'\]'),
    (tf_config(cluster={}), r'"cluster" should be a non-empty object'),
    (tf_config(cluster=["a:1"]), r'"cluster" should be a non-empty object'),
    (tf_config(cluster={"worker": "a:1,b:1"}), r"cluster.worker should be a non-empty list of \"host:port\""),
    (tf_config(cluster={"worker": []}), r"cluster.worker should be a non-empty list"),
    (tf_config(cluster={"worker": ["a:1"], "ps": ["b:1"]}), r'names a "ps" \(parameter server\) job.*'
                                                            r"ParameterServerStrategy"),
    (tf_config(cluster={"trainer": ["a:1", "b:1"]}, task_type="trainer"), r"unknown job 'trainer'"),
    (tf_config(cluster={"evaluator": ["a:1"]}, task_type="evaluator"), r'no "chief" or "worker" task'),
    (tf_config(cluster={"chief": ["a:1", "b:1"]}, task_type="chief"), r"cluster.chief lists 2 tasks; there can be "
                                                                      r"only one chief"),
    (tf_config(cluster={"worker": ["a", "b:1"]}), r"cluster.worker\[0\]: 'a' is not \"host:port\""),
    (tf_config(cluster={"worker": ["a:1", "b:70000"]}), r"cluster.worker\[1\]: 'b:70000' is not \"host:port\""),
    (tf_config(cluster={"worker": ["a:1", 2222]}), r"cluster.worker\[1\]: 2222 is not \"host:port\""),
    (tf_config(cluster={"worker": ["a:1", "b:1", "a:1"]}),
     r"cluster.worker\[2\] and cluster.worker\[0\] are the same address 'a:1'"),
    (tf_config(cluster={"chief": ["localhost:2222"], "worker": ["127.0.0.1:2222"]}),
     r"cluster.worker\[0\] and cluster.chief\[0\] are the same address '127.0.0.1:2222'"),
    (tf_config(cluster={"worker": ["Host1:5", "host1:5"]}), r"are the same address 'host1:5'"),
    (json.dumps({"cluster": {"worker": TWO}}), r'has no "task": each process needs to know which task it is'),
    (json.dumps({"cluster": {"worker": TWO}, "task": "worker:0"}), r'"task" should be an object'),
    (json.dumps({"cluster": {"worker": TWO}, "task": {"index": 0}}), r'task has no "type"'),
    (json.dumps({"cluster": {"worker": TWO}, "task": {"type": "", "index": 0}}), r'task has no "type"'),
    (json.dumps({"cluster": {"worker": TWO}, "task": {"type": 0, "index": 0}}),
     r"task.type should be a job name \(a string\)"),
    (json.dumps({"cluster": {"worker": TWO}, "task": {"type": "worker"}}),
     r'task has no "index": it should say which worker this process is, 0 to 1'),
    (tf_config(index="0"), r"task.index should be an integer .* from 0 to 1. Received: index='0'"),
    (tf_config(index=True), r"task.index should be an integer .*Received: index=True"),
    (tf_config(index=1.0), r"task.index should be an integer"),
    (tf_config(index=2), r"task.index 2 is out of range: cluster.worker lists 2 task\(s\), so the index should be "
                         r"0 to 1"),
    (tf_config(index=-1), r"task.index -1 is out of range"),
    (tf_config(task_type="chief"), r"task.type 'chief' is not a job of the cluster \['worker'\]\. Received"),
    (tf_config(task_type="master"),
     r"task.type 'master' is not a job of the cluster \['worker'\] \(MultiWorkerMirroredStrategy knows the jobs "
     r"\['chief', 'worker', 'evaluator'\]\)"),
    (tf_config(rpc_layer=7), r'"rpc_layer" should be a protocol name such as "grpc"'),
]


@pytest.mark.parametrize("text,message", BAD_TF_CONFIGS, ids=[str(i) for i in range(len(BAD_TF_CONFIGS))])
def test_bad_tf_config_is_a_clear_error(text, message):
    with pytest.raises(TfConfigError, match=message):
        cluster_config.parse_tf_config(text)
    assert issubclass(TfConfigError, ValueError)


@pytest.mark.parametrize("text", [None, "", "   \n"])
def test_unset_tf_config_is_single_host(text):
    assert cluster_config.parse_tf_config(text) is None


@pytest.mark.parametrize("cluster,task_type", [
    ({"chief": ["localhost:2222"]}, "chief"),  # chief only
    ({"worker": ["localhost:2222"]}, "worker"),  # one worker
    ({"worker": ["localhost:2222"], "evaluator": ["localhost:2223"]}, "worker"),  # one worker, an evaluator aside
    ({"chief": ["a:1"], "worker": ["b:1"], "evaluator": ["c:1"]}, "evaluator"),  # the evaluator trains alone
])
def test_one_member_or_the_evaluator_is_single_host(cluster, task_type):
    assert cluster_config.parse_tf_config(tf_config(cluster=cluster, task_type=task_type)) is None


def test_chief_and_workers_are_numbered_as_tensorflow_does():
    cluster = {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "evaluator": ["e:1"]}
    chief = cluster_config.parse_tf_config(tf_config(cluster=cluster, task_type="chief", rpc_layer="grpc"))
    worker1 = cluster_config.parse_tf_config(tf_config(cluster=cluster, index=1))
    assert (chief.task, chief.worker_id, chief.is_chief, chief.worker_count) == ("chief:0", 0, True, 3)
    assert (worker1.task, worker1.worker_id, worker1.is_chief, worker1.address) == ("worker:1", 2, False, "w1:1")
    assert worker1.peers == (("chief:0", "c:1"), ("worker:0", "w0:1"))  # the evaluator is no peer
    assert chief.rpc_layer == "grpc" and chief.source == "TF_CONFIG"
    assert chief.cluster_spec() == {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "evaluator": ["e:1"]}
    assert json.loads(json.dumps(worker1.to_dict()))["task"] == {"type": "worker", "index": 1}


def test_worker_zero_is_chief_without_a_chief_and_ipv6_addresses_parse():
    cluster = cluster_config.parse_tf_config(tf_config(cluster={"worker": ["[::1]:2222", "[fe80::1]:2222"]}))
    assert cluster.is_chief and cluster.peers == (("worker:1", "[fe80::1]:2222"),)
    assert cluster_config.split_address("[::1]:2222") == ("::1", 2222)
    assert cluster_config.split_address("node-7.cluster.local:12345") == ("node-7.cluster.local", 12345)


def test_cluster_from_a_resolver_is_validated_like_tf_config(tf):
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["n1:2222", "n2:2222"]}), task_type="worker", task_id=1, rpc_layer="grpc")
    cluster = ClusterConfig.from_resolver(resolver)
    assert (cluster.task, cluster.worker_count, cluster.source) == ("worker:1", 2, "SimpleClusterResolver")
    bad = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["n1:2222", "n1:2222"]}), task_type="worker", task_id=0)
    with pytest.raises(TfConfigError, match=r"SimpleClusterResolver cluster.worker\[1\] and cluster.worker\[0\]"):
        ClusterConfig.from_resolver(bad)
    sparse = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": {0: "n1:2222", 2: "n3:2222"}}), task_type="worker", task_id=0)
    with pytest.raises(TfConfigError, match=r"tasks numbered 0..N-1 without gaps"):
        ClusterConfig.from_resolver(sparse)


def test_cluster_from_slurm(tf, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # restored afterwards even if the resolver touched it
    for name, value in {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "node[1-2]",
                        "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_ID": "7"}.items():
        monkeypatch.setenv(name, value)
    resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(gpus_per_node=2, gpus_per_task=2,
                                                                   auto_set_gpu=False)
    cluster = ClusterConfig.from_resolver(resolver)
    assert cluster.to_dict()["cluster"] == {"worker": ["node1:8888", "node2:8888"]}
    assert (cluster.task, cluster.peers, cluster.source) == ("worker:1", (("worker:0", "node1:8888"),),
                                                             "SlurmClusterResolver")
    assert multi_worker._local_gpu_count(tf, resolver) == 2  # GPUs per worker come from the resolver


def test_single_host_arguments_are_refused_in_multi_worker_mode():
    multi_worker.check_single_host_options()  # the defaults are fine
    multi_worker.check_single_host_options(cross_device_ops="collective", xla_allreduce="split")
    with pytest.raises(ValueError, match=r"gpus='0,1' \(each worker uses every GPU.*CUDA_VISIBLE_DEVICES\); "
                                         r"cross_device_ops='nccl'.*; num_packs=2"):
        multi_worker.check_single_host_options(gpus="0,1", cross_device_ops="nccl", num_packs=2)


# ---- collective implementation per topology ----------------------------------------------------------------

@pytest.mark.parametrize("machine,gpus,expected,reason", [
    (h200_x2, 2, "NCCL", r"2 GPUs reach each other through NVSwitch \(478 GB/s per direction\)"),
    (h200_x2, 1, "NCCL", r"one GPU per worker: NCCL all-reduces across workers"),
    (h200_x2, 0, "RING", r"NVML sees 2 GPU\(s\) but this worker trains on none"),
    (h200_x2, 3, "NCCL", r"trains on 3 GPU\(s\) but NVML maps 2 of them \(\[0, 1\]\), so their links are uncertain"),
    (pcie_x4, 4, "NCCL", r"PCIe only, no NVLink; NCCL still"),
    (dgx1_v100_x8, 8, "NCCL", r"only some GPU pairs have NVLink"),
    (no_driver, 0, "RING", r"CPU-only worker: TensorFlow's ring all-reduce over gRPC"),
    (no_driver, 2, "NCCL", r"2 GPU\(s\) without NVML"),
])
def test_implementation_follows_the_local_topology(monkeypatch, machine, gpus, expected, reason):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    topology = nvml.probe(FakeNvml(machine()))
    name, why = policy.choose_implementation(topology, gpus)
    assert name == expected and re.search(reason, why), why


def test_cuda_visible_devices_picks_the_workers_gpus(monkeypatch):
    topology = nvml.probe(FakeNvml(pcie_x4()))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert policy.choose_implementation(topology, 1)[0] == "NCCL"
    name, why = policy.choose_implementation(nvml.probe(FakeNvml(h200_x2())), 2, visible=[1, 0])
    assert name == "NCCL" and "NVSwitch" in why
    with pytest.raises(ValueError, match=r"local_gpu_count should be a non-negative integer"):
        policy.choose_implementation(topology, -1)


def test_communication_options_are_tensorflow_objects(tf):
    options, reason = multi_worker.communication_options(nvml.probe(FakeNvml(h200_x2())), 2, visible=[0, 1])
    assert isinstance(options, type(tf.distribute.experimental.CommunicationOptions()))  # the factory's class
    assert options.implementation == tf.distribute.experimental.CommunicationImplementation.NCCL
    options, _ = multi_worker.communication_options(nvml.probe(FakeNvml(no_driver())), 0)
    assert options.implementation == tf.distribute.experimental.CommunicationImplementation.RING


# ---- waiting for peers -------------------------------------------------------------------------------------

def test_unreachable_peer_names_the_address_and_the_timeout():
    own, closed = free_ports(2)
    cluster = cluster_config.parse_tf_config(tf_config(cluster={"worker": [f"localhost:{own}",
                                                                         f"localhost:{closed}"]}))
    start = time.monotonic()
    with pytest.raises(rendezvous.PeerUnreachableError) as error:
        rendezvous.wait_for_peers(cluster, timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert 1.0 <= elapsed < 4.0, elapsed
    assert re.search(rf"worker:0 \(localhost:{own}\) could not reach 1 of its 1 peer\(s\) within 1 s: worker:1 at "
                     rf"localhost:{closed} \(connection refused: nothing listens on that port yet\)",
                     str(error.value)), str(error.value)
    assert "--peer_timeout" in str(error.value) and isinstance(error.value, TimeoutError)
    with socket.create_server(("", own)):  # the listener is gone: the port is free again
        pass


def test_peers_are_found_and_a_taken_own_port_is_an_error():
    own, peer = free_ports(2)
    cluster = cluster_config.parse_tf_config(tf_config(cluster={"worker": [f"localhost:{own}", f"localhost:{peer}"]}))
    with socket.create_server(("", peer)):
        reached = rendezvous.wait_for_peers(cluster, timeout_s=5.0)
    assert list(reached) == [f"localhost:{peer}"] and reached[f"localhost:{peer}"] < 5.0
    with socket.create_server(("", own)), pytest.raises(TfConfigError, match=rf"own address localhost:{own} "
                                                                             r"\(TF_CONFIG\) cannot be used"):
        rendezvous.wait_for_peers(cluster, timeout_s=1.0)
    with pytest.raises(ValueError, match=r"peer_timeout_s should be a positive number"):
        rendezvous.wait_for_peers(cluster, timeout_s=0)


def test_build_strategy_fails_fast_on_an_unreachable_peer_and_after_program_start(tf, monkeypatch):
    """A closed peer port gives PeerUnreachableError after the timeout; once TensorFlow has run an op, building the
    strategy is refused with an explanation instead of TensorFlow's own error. In this process, whose runtime has
    started: the first check is told it has not (a fresh process, where it has not, builds the strategy in the
    training benchmark's `workers` test, tests/tools/test_training_bench.py), and no strategy is ever started."""
    from tf_nvlink.internals import tf_runtime as internals

    own, closed = free_ports(2)
    cluster = cluster_config.parse_tf_config(tf_config(cluster={"worker": [f"localhost:{own}",
                                                                         f"localhost:{closed}"]}))
    monkeypatch.setattr(multi_worker, "_start_strategy", lambda *args: pytest.fail("started a strategy"))
    with monkeypatch.context() as fresh:
        fresh.setattr(internals, "tensorflow_runtime_started", lambda: False)
        start = time.monotonic()
        with pytest.raises(rendezvous.PeerUnreachableError) as unreachable:
            multi_worker.build_strategy(Topology(), cluster, peer_timeout_s=1.0)
        assert 1.0 <= time.monotonic() - start < 5.0
    assert f"worker:1 at localhost:{closed} (connection refused" in str(unreachable.value)
    assert "within 1 s" in str(unreachable.value)
    tf.constant(1.0) + 1.0
    assert internals.tensorflow_runtime_started()
    with pytest.raises(RuntimeError, match=r"^MultiWorkerMirroredStrategy must be created at program start, before "
                                           r"any TensorFlow op runs"):
        multi_worker.build_strategy(Topology(), cluster, peer_timeout_s=1.0)


# ---- the plan ----------------------------------------------------------------------------------------------

def _plan(workers):
    cluster = cluster_config.parse_tf_config(tf_config(index=1))
    local = policy.Plan(gpus=(0, 1), cross_device_ops="collective", num_packs=None, reason="r", fingerprint="abc",
                        shape="nvswitch", nvlink_gbps=478.1, devices=("/job:worker/task:1/device:GPU:0",
                                                                      "/job:worker/task:1/device:GPU:1"))
    return MultiWorkerPlan(local=local, cluster=cluster, implementation="NCCL", implementation_reason="why",
                           local_gpu_count=2, workers=workers)


def test_plan_summary_lists_every_workers_topology():
    info = [WorkerInfo(f"worker:{i}", TWO[i], f"host{i}", fp, "nvswitch", 2, "NCCL") for i, fp in enumerate("ab")]
    plan = _plan(tuple(info))
    assert plan.summary() == (
        "tf_nvlink plan: MultiWorkerMirroredStrategy, 2 workers x 2 GPU replica(s) = 4 replicas; this is worker:1 "
        "at localhost:2223: GPUs [0, 1] (nvswitch, 478 GB/s per direction over NVLink) -> CollectiveAllReduce "
        "NCCL: why [topology abc; workers' topologies: worker:0 a, worker:1 b (2 different topologies)]")
    assert (plan.gpus, plan.shape, plan.on_cpu, plan.num_replicas) == ((0, 1), "nvswitch", False, 4)  # the local plan's
    record = json.loads(json.dumps(plan.to_dict()))
    assert record["strategy"] == "MultiWorkerMirroredStrategy" and record["cluster"]["worker_id"] == 1
    assert [w["hostname"] for w in record["workers"]] == ["host0", "host1"]
    assert "workers' topologies" not in _plan((None, None)).summary()


def test_workers_with_different_gpu_counts_are_refused():
    multi_worker._check_agreement([WorkerInfo("worker:0", "a:1", "h", "x", "single", 1, "NCCL"), None])
    with pytest.raises(RuntimeError, match=r"The workers disagree: worker:0 on h0: 2 GPU\(s\), NCCL; worker:1 on h1: "
                                           r"0 GPU\(s\), RING\. .*same number of GPUs"):
        multi_worker._check_agreement([WorkerInfo("worker:0", "a:1", "h0", "x", "nvswitch", 2, "NCCL"),
                                       WorkerInfo("worker:1", "b:1", "h1", "y", "none", 0, "RING")])


# ---- two workers, end to end -------------------------------------------------------------------------------

def example_cluster(jobs):
    """({job: [localhost addresses]}, [(job, index)]) for the example's workers, on free ports."""
    cluster: dict = {}
    tasks = []
    for job, port in zip(jobs, free_ports(len(jobs))):
        cluster.setdefault(job, []).append(f"localhost:{port}")
        tasks.append((job, len(cluster[job]) - 1))
    return cluster, tasks


def start_example_workers(tmp_path, cluster, tasks, argvs, tag=""):
    """Start examples/multi_worker.py once per task (argvs: one argument list each); (processes, log paths)."""
    base_env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    processes, logs = [], []
    for (job, index), argv in zip(tasks, argvs):
        log = tmp_path / f"{tag}{job}{index}.log"
        env = dict(base_env, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": job, "index": index}}))
        with open(log, "w") as out:  # the child keeps its own copy of the descriptor
            processes.append(subprocess.Popen([sys.executable, EXAMPLE, *argv], env=env, cwd=ROOT, stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        logs.append(log)
    return processes, logs


def kill_workers(processes):
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # TensorFlow's workers ignore SIGTERM while they wait
            process.wait()


def run_example_workers(tmp_path, cluster, tasks, argvs, tag="", timeout=110):
    """Run the workers to the end (killed after `timeout` s, failing the test); (return codes, outputs)."""
    processes, logs = start_example_workers(tmp_path, cluster, tasks, argvs, tag)
    try:
        deadline = time.monotonic() + timeout
        for process in processes:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"workers did not finish within {timeout} s:\n" + "\n".join(p.read_text()[-3000:] for p in logs))
    finally:
        kill_workers(processes)
    return [p.returncode for p in processes], [log.read_text() for log in logs]


@pytest.mark.slow
@pytest.mark.parametrize("jobs", [("worker", "worker"), ("chief", "worker")], ids=["2_workers", "chief_and_worker"])
def test_two_workers_train_the_mlp_in_sync(tmp_path, jobs):
    cluster, tasks = example_cluster(jobs)
    model_dir = tmp_path / "model"
    argv = ["--dataset", "digits", "--epochs", "3", "--steps_per_epoch", "5", "--batch_size", "64", "--model_dir",
            str(model_dir), "--peer_timeout", "60"]
    codes, outputs = run_example_workers(tmp_path, cluster, tasks, [argv, argv])
    for code, output in zip(codes, outputs):
        assert code == 0, output[-5000:]

    checksums, losses = [], []
    names = [f"{job}:{index}" for job, index in tasks]
    for (job, index), output in zip(tasks, outputs):
        assert re.search(rf"^tf_nvlink plan: MultiWorkerMirroredStrategy, 2 workers x 1 CPU replica = 2 replicas; "
                         rf"this is {job}:{index}.* -> CollectiveAllReduce RING: .*workers' topologies: "
                         rf"{names[0]} \w+, {names[1]} \w+ \(same topology everywhere\)\]$", output, re.M), output
        assert "replicas: 2, global batch 64 = 32 per replica, 5 steps per epoch" in output
        checksums.append(re.search(r"^final weights: sha256 (\w+) \(235,146 parameters\)$", output, re.M).group(1))
        losses.append([float(v) for v in re.search(r"^loss per epoch: (.*)$", output, re.M).group(1).split()])
        assert re.search(r"^test accuracy: \d\.\d{4}$", output, re.M), output
    assert checksums[0] == checksums[1]  # the workers ended with the same weights
    for loss in losses:
        assert len(loss) == 3 and loss[-1] < loss[0], losses
    assert f"saved {model_dir}/model.keras" in outputs[0]  # the chief (or worker 0) keeps the model
    assert "not the chief: saved to a temporary directory, deleted" in outputs[1]
    assert [p.name for p in model_dir.iterdir()] == ["model.keras"]


@pytest.mark.parametrize("workers, environ, expected", [
    (["localhost:1", "127.0.0.1:2"], {}, {"NCCL_SOCKET_IFNAME": "lo"}),
    (["[::1]:1", "localhost:2"], {}, {"NCCL_SOCKET_IFNAME": "lo"}),
    (["localhost:1", "localhost:2"], {"NCCL_SOCKET_IFNAME": "eth0"}, {}),  # the user's choice stays
    (["localhost:1", "host2:2"], {}, {}),  # several hosts: NCCL picks the network interface
])
def test_nccl_bootstraps_over_loopback_when_the_whole_cluster_is_local(workers, environ, expected):
    cluster = cluster_config.parse_tf_config(tf_config(cluster={"worker": workers}))
    assert cluster_config.loopback_nccl_env(cluster, environ=environ) == expected


def _final_checksum(output):
    return re.search(r"^final weights: sha256 (\w+) ", output, re.M).group(1)


@pytest.mark.slow
def test_killed_workers_resume_from_the_chiefs_backup_and_refuse_to_disagree(tmp_path):
    """SIGKILL both workers mid-run; a restart where one worker cannot see the backup stops with both epochs
    named; a restart with the same command on both resumes after the last finished epoch, in sync."""
    cluster, tasks = example_cluster(("worker", "worker"))
    model_dir = tmp_path / "model"
    metadata = model_dir / "backup" / "training_metadata.json"
    common = ["--dataset", "digits", "--steps_per_epoch", "5", "--batch_size", "64", "--peer_timeout", "60"]
    argv = [*common, "--epochs", "1000", "--model_dir", str(model_dir)]
    processes, logs = start_example_workers(tmp_path, cluster, tasks, [argv, argv], tag="killed_")
    try:
        deadline = time.monotonic() + 100
        while not (metadata.exists() and json.loads(metadata.read_text())["epoch"] >= 2):
            assert all(p.poll() is None for p in processes), "\n".join(p.read_text()[-3000:] for p in logs)
            assert time.monotonic() < deadline, "no backup of epoch 2 within 100 s"
            time.sleep(0.05)
    finally:
        kill_workers(processes)
    done = json.loads(metadata.read_text())["epoch"]

    cluster, tasks = example_cluster(("worker", "worker"))  # fresh ports: the killed workers' may linger
    lost = [*common, "--epochs", str(done + 2), "--model_dir", str(tmp_path / "elsewhere")]
    codes, outputs = run_example_workers(tmp_path, cluster, tasks, [[*common, "--epochs", str(done + 2),
                                                                     "--model_dir", str(model_dir)], lost],
                                         tag="disagree_")
    for code, output in zip(codes, outputs):
        assert code != 0 and f"The workers disagree on resume_epoch (worker:0: {done}, worker:1: 0)" in output, \
            output[-3000:]
    assert json.loads(metadata.read_text())["epoch"] == done  # the backup is untouched

    cluster, tasks = example_cluster(("worker", "worker"))
    again = [*common, "--epochs", str(done + 2), "--model_dir", str(model_dir)]
    codes, outputs = run_example_workers(tmp_path, cluster, tasks, [again, again], tag="resumed_")
    for code, output in zip(codes, outputs):
        assert code == 0, output[-5000:]
        assert f"resuming at epoch {done + 1}/{done + 2} ({done} finished before the run stopped)" in output
        assert len(re.search(r"^loss per epoch: (.*)$", output, re.M).group(1).split()) == 2, output[-3000:]
    assert _final_checksum(outputs[0]) == _final_checksum(outputs[1])
    assert sorted(p.name for p in model_dir.iterdir()) == ["model.keras"]  # the backup is gone after the save
