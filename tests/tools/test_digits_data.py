"""tf_nvlink.tools.digits_data: the offline digits, the MNIST loader and the "auto" fallback. Fast and offline."""

import time

import numpy as np
import pytest

from conftest import run_python
from error_messages import raises_naming
from tf_nvlink.tools import digits_data


@pytest.fixture(scope="module")
def digits():
    return digits_data.load_mnist_or_fallback("digits")


def _offline(monkeypatch):
    monkeypatch.setattr(digits_data, "mnist_reachable", lambda timeout=None: (False, "no internet (test)"))


def test_digits_shapes_dtypes_and_ranges(digits):
    x_train, y_train, x_test, y_test, description = digits
    assert x_train.shape == (1437, 784) and x_test.shape == (360, 784)
    assert y_train.shape == (1437,) and y_test.shape == (360,)
    assert x_train.dtype == x_test.dtype == np.float32
    assert np.issubdtype(y_train.dtype, np.integer) and np.issubdtype(y_test.dtype, np.integer)
    for x in (x_train, x_test):
        assert 0.0 <= x.min() and x.max() <= 1.0 and x.max() > 0.9
    assert set(np.unique(y_train)) == set(range(10)) == set(np.unique(y_test))
    assert "UCI" in description and "1437 train / 360 test" in description


def test_digits_split_is_stratified_disjoint_and_deterministic(digits):
    again = digits_data.load_digits()
    for a, b in zip(digits[:4], again[:4], strict=True):
        np.testing.assert_array_equal(a, b)
    train_rows = {row.tobytes() for row in digits.x_train}
    assert not any(row.tobytes() in train_rows for row in digits.x_test)  # the 1,797 images are all distinct
    test_share = np.bincount(digits.y_test, minlength=10) / np.bincount(
        np.concatenate([digits.y_train, digits.y_test]), minlength=10)
    assert np.all(np.abs(test_share - 0.2) < 0.01)
    other_seed = digits_data.load_digits(seed=1)
    assert not np.array_equal(other_seed.y_test, digits.y_test)


def test_stratified_split_sizes():
    labels = np.repeat(np.arange(3), [10, 7, 4])
    train, test = digits_data.stratified_split(labels, 0.25, seed=0)
    assert len(test) == 6 and len(train) == 15  # ceil(0.25 * 21), as scikit-learn
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(21))
    assert np.bincount(labels[test]).tolist() == [3, 2, 1]  # 2.86, 2.0, 1.14 rounded by largest remainder


def test_upsample_keeps_range_and_constants():
    images = np.random.default_rng(0).uniform(0, 1, (3, 8, 8)).astype(np.float32)
    up = digits_data.upsample(images, 28)
    assert up.shape == (3, 28, 28) and up.dtype == np.float32
    assert images.min() <= up.min() and up.max() <= images.max() + 1e-6
    np.testing.assert_allclose(digits_data.upsample(np.full((1, 8, 8), 0.5), 28), 0.5, atol=1e-6)


def test_auto_falls_back_to_digits_offline(monkeypatch, tmp_path):
    _offline(monkeypatch)
    start = time.perf_counter()
    x_train, _, x_test, _, description = digits_data.load_mnist_or_fallback("auto", cache_dir=str(tmp_path))
    assert time.perf_counter() - start < 5
    assert x_train.shape == (1437, 784) and x_test.shape == (360, 784)
    assert "could not be downloaded (no internet (test))" in description
    assert str(tmp_path / "datasets" / "mnist.npz") in description and "UCI" in description


def test_reachability_check_gives_up_within_its_timeout(monkeypatch):
    # 192.0.2.1 is TEST-NET-1: never routed. Offline it fails at once; online the connection times out.
    monkeypatch.setattr(digits_data, "MNIST_URL", "http://192.0.2.1/mnist.npz")
    start = time.perf_counter()
    reachable, reason = digits_data.mnist_reachable(timeout=0.5)
    assert time.perf_counter() - start < 3
    assert not reachable and reason


def test_auto_falls_back_when_the_cached_mnist_is_broken(monkeypatch, tmp_path):
    cached = tmp_path / "datasets" / "mnist.npz"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"not an npz")  # wrong hash: Keras re-downloads, which fails (connection refused)
    monkeypatch.setattr(digits_data, "MNIST_URL", "http://127.0.0.1:9/mnist.npz")
    data = digits_data.load_mnist_or_fallback("auto", cache_dir=str(tmp_path))
    assert data.x_train.shape == (1437, 784)
    assert data.description.startswith("MNIST could not be loaded (")


def _fake_mnist(path, n_train=6, n_test=4):
    rng = np.random.default_rng(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x_train=rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
             y_train=rng.integers(0, 10, n_train, dtype=np.uint8),
             x_test=np.full((n_test, 28, 28), 255, dtype=np.uint8), y_test=np.arange(n_test, dtype=np.uint8))


def test_mnist_from_cache_is_flattened_and_scaled(monkeypatch, tmp_path):
    import keras

    cached = tmp_path / "datasets" / "mnist.npz"
    _fake_mnist(cached)
    monkeypatch.setattr(keras.utils, "get_file", lambda *args, **kwargs: str(cached))  # skip the hash check
    x_train, y_train, x_test, y_test, description = digits_data.load_mnist_or_fallback("auto", str(tmp_path))
    assert x_train.shape == (6, 784) and x_test.shape == (4, 784)
    assert x_train.dtype == np.float32 and 0 <= x_train.min() and x_train.max() <= 1
    np.testing.assert_array_equal(x_test, 1.0)
    assert y_test.tolist() == [0, 1, 2, 3] and np.issubdtype(y_train.dtype, np.integer)
    assert description.startswith("MNIST (6 train / 4 test, 28x28) from the Keras cache ")


def test_mnist_cache_path_follows_keras(monkeypatch, tmp_path):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    assert digits_data.mnist_cache_path() == tmp_path / "datasets" / "mnist.npz"
    assert digits_data.mnist_cache_path("/data/k") == digits_data.Path("/data/k/datasets/mnist.npz")


def test_bad_name_lists_the_choices():
    with pytest.raises(ValueError, match=r"name should be one of \['auto', 'mnist', 'digits'\]. "
                                         r"Received: name='fashion'"):
        digits_data.load_mnist_or_fallback("fashion")


def test_import_and_digits_do_not_import_tensorflow():
    result = run_python("import sys; from tf_nvlink.tools import digits_data; digits_data.load_mnist_or_fallback('digits'); "
                        "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_digits_file_is_packaged():
    assert digits_data.DIGITS_PATH.is_file()
    assert digits_data.DIGITS_PATH.name == "digits.csv.gz" and digits_data.DIGITS_PATH.parent.name == "data"


BAD_ARGUMENTS = [  # (id, call, needles)
    ("dataset name", lambda: digits_data.load_mnist_or_fallback("cifar10"),
     ("name='cifar10'", "['auto', 'mnist', 'digits']")),
    ("dataset timeout", lambda: digits_data.load_mnist_or_fallback("auto", timeout=-1),
     ("timeout=-1", "positive number")),
    ("test fraction", lambda: digits_data.load_digits(test_fraction=1.5), ("test_fraction=1.5", "between 0 and 1")),
]


@pytest.mark.parametrize("call, needles", [c[1:] for c in BAD_ARGUMENTS], ids=[c[0] for c in BAD_ARGUMENTS])
def test_bad_arguments_name_the_value_and_the_choices(call, needles):
    raises_naming(call, *needles)
