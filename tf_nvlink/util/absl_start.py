"""Running a function when absl's `app.run` starts, before it parses the flags and runs its init callbacks.

A script written the usual absl way imports TensorFlow at its top and calls `app.run(main)` at its end. Importing
TensorFlow registers an absl init callback that lists its devices (`tensorflow/python/distribute/combinations.py`,
`app.call_after_init(_set_total_phsyical_gpus)`), and `app.run` runs the init callbacks before `main`. absl runs
them in an order it does not promise, so a callback of ours would not surely come first; `before_app_run` wraps
`absl.app.run` itself instead: `app.run(main)` looks the attribute up when it is called. A script that bound the
function before the wrap (`from absl.app import run`) runs absl's own.

Example:
    >>> from tf_nvlink.util import absl_start
    >>> absl_start.before_app_run(lambda: print("before the flags and the init callbacks"))
    True
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

_CALLBACKS: list = []


def before_app_run(callback: Callable[[], None]) -> bool:
    """Call `callback()` each time absl's `app.run` starts, before anything of absl's; True when it is set up,
    False when absl's `app` module is not imported (this module never imports absl: importing it costs ~30 ms).
    The same callback registered twice runs once.

    Example:
        >>> before_app_run(prepare_something)
        True
    """
    if not callable(callback):
        raise TypeError(f"before_app_run takes a function of no arguments. Received: {callback!r}")
    app = sys.modules.get("absl.app")
    if app is None or not callable(getattr(app, "run", None)):
        return False
    if callback not in _CALLBACKS:
        _CALLBACKS.append(callback)
    if not getattr(app.run, "tf_nvlink_wrapped", False):
        app.run = _wrapped(app.run)
    return True


def _wrapped(run: Callable) -> Callable:
    @functools.wraps(run)
    def run_after_callbacks(*args, **kwargs):
        for callback in list(_CALLBACKS):
            callback()
        return run(*args, **kwargs)

    run_after_callbacks.tf_nvlink_wrapped = True
    return run_after_callbacks
