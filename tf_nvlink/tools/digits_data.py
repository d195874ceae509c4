"""Handwritten digits for the examples: MNIST when it can be had, otherwise a real offline digits set.

`load_mnist_or_fallback()` returns float32 images flattened to 784 values in [0, 1], int64 labels 0-9, and a
one-line description saying which data set was used and why:

- "mnist": MNIST (60,000 train / 10,000 test, 28x28) through `keras.datasets.mnist.load_data()`, which reads
  the Keras cache (`~/.keras/datasets/mnist.npz`, or `$KERAS_HOME/datasets/`) or downloads it.
- "digits": the UCI "Optical Recognition of Handwritten Digits" test set (1,797 8x8 images, pixel counts
  0-16), shipped with this package as `tf_nvlink/tools/data/digits.csv.gz`; upsampled bilinearly to 28x28 so the
  same 784-input model applies, and split 80/20 per class with a fixed seed (1,437 train / 360 test).
- "auto": MNIST if it is in the cache, or if its server answers within `timeout` seconds (Keras then downloads
  the 11 MB file); else, or if loading MNIST fails, "digits". It never fails for lack of internet.

Attribution: digits.csv.gz is the copy of the UCI data set distributed with scikit-learn 1.9.1
(`sklearn/datasets/data/digits.csv.gz`, unchanged: 64 pixel columns then the label, no header). Data set by
E. Alpaydin and C. Kaynak (1998), "Optical Recognition of Handwritten Digits", UCI Machine Learning
Repository, https://archive.ics.uci.edu/ml/datasets/Optical+Recognition+of+Handwritten+Digits, licensed
CC BY 4.0. It is the writer-independent test part of that set (43 writers in all; these 1,797 images come from 13).

Example:
    >>> from tf_nvlink.tools import digits_data
    >>> x_train, y_train, x_test, y_test, description = digits_data.load_mnist_or_fallback("digits")
    >>> x_train.shape, x_test.shape
    ((1437, 784), (360, 784))

TensorFlow and Keras are imported only when MNIST is actually loaded.
"""

from __future__ import annotations

import gzip
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np

CHOICES = ("auto", "mnist", "digits")
MNIST_URL = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz"  # what Keras downloads
DIGITS_PATH = Path(__file__).resolve().parent / "data" / "digits.csv.gz"
IMAGE_SIZE = 28  # MNIST's side; the 8x8 digits are upsampled to it
DEFAULT_TIMEOUT_S = 5.0


class Digits(NamedTuple):
    """Train and test images (N, 784) float32 in [0, 1], labels (N,) int64 in 0-9, and what they are."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    description: str


def load_mnist_or_fallback(name: str = "auto", cache_dir: Optional[str] = None,
                           timeout: float = DEFAULT_TIMEOUT_S) -> Digits:
    """Load "mnist", "digits", or ("auto") MNIST when available and the offline digits otherwise.

    Args:
        name: "auto", "mnist" or "digits".
        cache_dir: the Keras home holding `datasets/mnist.npz` (default: Keras's own, `$KERAS_HOME` or
            `~/.keras`).
        timeout: seconds "auto" waits for the MNIST server to answer before falling back to the digits.

    Returns:
        A `Digits` tuple: (x_train, y_train, x_test, y_test, description).

    Raises:
        ValueError: for an unknown `name` or a `timeout` that is not a positive number.
        Exception: name="mnist" and MNIST is neither cached nor downloadable (Keras's own error).
    """
    if name not in CHOICES:
        raise ValueError(f"name should be one of {list(CHOICES)}. Received: name={name!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"timeout should be a positive number of seconds. Received: timeout={timeout!r}")
    if name == "digits":
        return load_digits()
    if name == "mnist":
        return load_mnist(cache_dir)
    path = mnist_cache_path(cache_dir)
    if not path.exists():
        reachable, reason = mnist_reachable(timeout)
        if not reachable:
            return load_digits(why=f"MNIST is not cached at {path} and could not be downloaded ({reason})")
    try:
        return load_mnist(cache_dir)
    except Exception as error:  # noqa: BLE001 - a broken download or cache must not stop the example
        return load_digits(why=f"MNIST could not be loaded ({type(error).__name__}: {_first_line(error)})")


def load_mnist(cache_dir: Optional[str] = None) -> Digits:
    """MNIST through Keras (cached file or download), flattened and scaled to [0, 1]."""
    import keras  # noqa: PLC0415 - imports TensorFlow: only here

    path = mnist_cache_path(cache_dir)
    source = f"from the Keras cache {path}" if path.exists() else f"downloaded to {path}"
    if cache_dir is None:
        (x_train, y_train), (x_test, y_test) = keras.datasets.mnist.load_data()
    else:  # load_data() has no cache_dir; this is its own get_file call with one
        local = keras.utils.get_file(
            "mnist.npz", MNIST_URL, cache_dir=str(cache_dir),
            file_hash="731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1")
        with np.load(local, allow_pickle=False) as f:
            x_train, y_train, x_test, y_test = f["x_train"], f["y_train"], f["x_test"], f["y_test"]
    description = f"MNIST ({len(x_train)} train / {len(x_test)} test, 28x28) {source}"
    return Digits(_flatten(x_train, 255.0), y_train.astype(np.int64), _flatten(x_test, 255.0),
                  y_test.astype(np.int64), description)


def load_digits(test_fraction: float = 0.2, seed: int = 0, why: str = "") -> Digits:
    """The shipped UCI digits, upsampled to 28x28 and split per class (deterministic for a given seed).

    `why` goes into the description (e.g. why MNIST was not used).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction should be between 0 and 1. Received: test_fraction={test_fraction!r}")
    with gzip.open(DIGITS_PATH, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    images = upsample(table[:, :64].reshape(-1, 8, 8) / 16.0, IMAGE_SIZE)
    labels = table[:, 64].astype(np.int64)
    train_idx, test_idx = stratified_split(labels, test_fraction, seed)
    description = (f"UCI handwritten digits (offline copy shipped with tf_nvlink; {len(train_idx)} train / "
                   f"{len(test_idx)} test, 8x8 upsampled to 28x28)")
    if why:
        description = f"{why}: using the {description}"
    flat = images.reshape(len(images), -1)
    return Digits(flat[train_idx], labels[train_idx], flat[test_idx], labels[test_idx], description)


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices holding each class in the same proportion; both shuffled, deterministic.

    The test set has ceil(test_fraction * N) examples (as scikit-learn's `train_test_split`), shared between
    classes by largest remainder.
    """
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    n_test = int(np.ceil(test_fraction * len(labels)))
    exact = counts * n_test / len(labels)
    per_class = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - per_class), kind="stable")[: n_test - per_class.sum()]:
        per_class[i] += 1
    train, test = [], []
    for cls, k in zip(classes, per_class, strict=True):
        members = rng.permutation(np.flatnonzero(labels == cls))
        test.append(members[:k])
        train.append(members[k:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def upsample(images: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize of (N, h, w) images to (N, size, size), half-pixel centres (as tf.image.resize)."""
    rows = _interpolation_matrix(images.shape[1], size)
    cols = _interpolation_matrix(images.shape[2], size)
    return np.einsum("ij,njk,lk->nil", rows, images, cols).astype(np.float32)


def mnist_cache_path(cache_dir: Optional[str] = None) -> Path:
    """Where Keras keeps (or would download) mnist.npz: <cache_dir or Keras home>/datasets/mnist.npz."""
    if cache_dir is None:
        if "KERAS_HOME" in os.environ:  # Keras's own rule (keras/src/backend/config.py)
            cache_dir = os.environ["KERAS_HOME"]
        else:
            home = os.path.expanduser("~")
            cache_dir = os.path.join(home if os.access(home, os.W_OK) else "/tmp", ".keras")
    return Path(os.path.expanduser(cache_dir)) / "datasets" / "mnist.npz"


def mnist_reachable(timeout: float = DEFAULT_TIMEOUT_S) -> tuple[bool, str]:
    """Whether the MNIST server answers within `timeout` seconds, and if not, why ("no internet", ...)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(MNIST_URL, method="HEAD"), timeout=timeout):
            return True, ""
    except urllib.error.HTTPError as error:
        return False, f"HTTP {error.code} from {MNIST_URL}"
    except urllib.error.URLError as error:
        text = str(error.reason)
        if "Name or service not known" in text or "name resolution" in text or "nodename nor servname" in text:
            return False, "no internet: the server's name does not resolve"
        if isinstance(error.reason, TimeoutError) or "timed out" in text:
            return False, f"no answer from the server within {timeout:g} s"
        return False, f"no internet: {text}"
    except (TimeoutError, OSError) as error:
        return False, f"no answer from the server within {timeout:g} s ({type(error).__name__})"


def _interpolation_matrix(src: int, dst: int) -> np.ndarray:
    """(dst, src) weights of linear interpolation with half-pixel centres, edges clamped."""
    centres = np.clip((np.arange(dst) + 0.5) * src / dst - 0.5, 0, src - 1)
    low = np.floor(centres).astype(int)
    high = np.minimum(low + 1, src - 1)
    frac = centres - low
    matrix = np.zeros((dst, src), dtype=np.float64)
    matrix[np.arange(dst), low] += 1.0 - frac
    matrix[np.arange(dst), high] += frac
    return matrix


def _flatten(images: np.ndarray, scale: float) -> np.ndarray:
    return (images.reshape(len(images), -1).astype(np.float32) / np.float32(scale))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else "no message"
