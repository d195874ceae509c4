"""tf_nvlink.machine.cluster_config: TF_CONFIG parsed strictly, each bad one refused naming the value and the form."""

import json

import pytest

from error_messages import raises_naming
from tf_nvlink.machine import cluster_config


def _tf_config(task=None, cluster=None, **extra):
    data = {"cluster": {"worker": ["a:1", "b:1"]} if cluster is None else cluster,
            "task": {"type": "worker", "index": 0} if task is None else task, **extra}
    return json.dumps(data)


TF_CONFIG_CASES = [  # (id, TF_CONFIG text, needles: the bad value, and the valid choices or form)
    ("not JSON", "not json", ("TF_CONFIG='not json'", "It should look like")),
    ("not an object", "[1, 2]", ("TF_CONFIG='[1, 2]'", "should be a JSON object")),
    ("NaN", _tf_config().replace('"index": 0', '"index": NaN'), ("NaN", "not JSON")),
    ("duplicate key", _tf_config()[:-1] + ', "task": {"type": "worker", "index": 1}}', ("'task' twice",)),
    ("huge number", _tf_config().replace('"index": 0', '"index": 1e999'), ("index=inf", "0 to 1")),
    ("no cluster", json.dumps({"task": {"type": "worker", "index": 0}}), ('no "cluster"', "['task']")),
    ("ps job", _tf_config(cluster={"ps": ["a:1"], "worker": ["b:1"]}), ('"ps"', "['chief', 'worker', 'evaluator']")),
    ("unknown job", _tf_config(cluster={"trainer": ["a:1"]}, task={"type": "trainer", "index": 0}),
     ("'trainer'", "['chief', 'worker', 'evaluator']")),
    ("same address", _tf_config(cluster={"worker": ["localhost:2222", "127.0.0.1:2222"]}),
     ("'127.0.0.1:2222'", "its own host:port")),
    ("no port", _tf_config(cluster={"worker": ["hostonly", "b:1"]}), ("'hostonly'", '"host:port"')),
    ("bad port", _tf_config(cluster={"worker": ["a:99999", "b:1"]}), ("'a:99999'", "1 to 65535")),
    ("task type not in cluster", _tf_config(task={"type": "chief", "index": 0}), ("'chief'", "['worker']")),
    ("index out of range", _tf_config(task={"type": "worker", "index": 2}), ("'index': 2", "0 to 1")),
    ("index as string", _tf_config(task={"type": "worker", "index": "0"}), ("index='0'", "0 to 1")),
    ("index as bool", _tf_config(task={"type": "worker", "index": True}), ("index=True", "0 to 1")),
    ("no task", json.dumps({"cluster": {"worker": ["a:1", "b:1"]}}), ('no "task"', '"type": "worker"')),
    ("rpc_layer", _tf_config(rpc_layer=5), ("rpc_layer=5", '"grpc"')),
]


@pytest.mark.parametrize("text, needles", [c[1:] for c in TF_CONFIG_CASES], ids=[c[0] for c in TF_CONFIG_CASES])
def test_bad_tf_config(text, needles):
    raises_naming(lambda: cluster_config.parse_tf_config(text), *needles, error=cluster_config.TfConfigError)
