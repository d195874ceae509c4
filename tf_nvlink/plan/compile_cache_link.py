"""The compile cache of a program whose TensorFlow lists its devices before `tf_nvlink.strategy()` is built: a
per-process link named in `TF_XLA_FLAGS`, pointed at the strategy's context folder once the strategy knows it.

TensorFlow parses `TF_XLA_FLAGS` once, at its first device listing (`tensorflow/compiler/jit/flags.cc`:
`AllocateAndParseFlags` under `absl::call_once`; the variable is read once and its flags consumed, so neither a
later change nor `ResetJitCompilerFlags` reads it again). It keeps the directory as a string, hands it to each
device's compiler when that compiler is made, at the device's first XLA compile (`xla_platform_info.cc`:
`BuildXlaDeviceCompiler`), and opens each entry as `directory/name` when it looks one up or writes one
(`device_executable_persistor.h`). Under absl's `app.run` the devices are listed before `main`, so before the
strategy's arguments, which the context folder's name hashes (`compile_cache.request_text`), are known.

`make_link` (when `app.run` starts; `tf_nvlink/__init__.py`) puts `<temp>/tf_nvlink-xla-XXXXXX/cache` in
`TF_XLA_FLAGS`: a symbolic link to an empty scratch folder of this process. `point_link` (the strategy, before
its first XLA compile) points it at the context folder: TensorFlow then reads and writes that folder's entries,
and a process whose strategy differs from another's reads its own context, never the other's. The link's folder
is deleted when the process exits (the scratch folder with it: what TensorFlow wrote there was never read by
another process); the entries it linked to are never touched. No TensorFlow import here.

Example:
    >>> from tf_nvlink.plan import compile_cache_link
    >>> link = compile_cache_link.make_link()           # before TensorFlow lists its devices
    >>> compile_cache_link.point_link("/home/me/.cache/tf_nvlink/xla/3f0c9a1e22b4d5c6")
    '/home/me/.cache/tf_nvlink/xla/3f0c9a1e22b4d5c6'
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from typing import MutableMapping, Optional

from tf_nvlink.plan import compile_cache

log = logging.getLogger("tf_nvlink")
FOLDER_PREFIX = "tf_nvlink-xla-"
_LINK: dict = {}  # "link": the path in TF_XLA_FLAGS, "folder": the process's folder holding it; set once


def current_link() -> Optional[str]:
    """The link `make_link` put in `TF_XLA_FLAGS` in this process, or None."""
    return _LINK.get("link")


def make_link(environ: Optional[MutableMapping[str, str]] = None) -> Optional[str]:
    """Name this process's link in `environ["TF_XLA_FLAGS"]` (default os.environ) before TensorFlow lists its
    devices: `<temp>/tf_nvlink-xla-XXXXXX/cache`, pointing at an empty scratch folder until `point_link`. Returns
    the link, or None when none is made: the environment turns the cache off (`TF_NVLINK_COMPILE_CACHE=off`),
    `TF_XLA_FLAGS` names the user's own folder, the temporary folder's path cannot go into `TF_XLA_FLAGS`, or
    this system makes no symbolic links. A second call returns the first link.

    Example:
        >>> make_link()
        '/tmp/tf_nvlink-xla-k2j4x1/cache'
    """
    environ = os.environ if environ is None else environ
    current = environ.get("TF_XLA_FLAGS", "")
    if "link" in _LINK:
        return _LINK["link"]
    if compile_cache.users_cache_folder(current) is not None:
        return None
    try:
        root = compile_cache.root_folder(compile_cache.validate_setting("auto"), environ)
    except ValueError:
        return None  # a bad TF_NVLINK_COMPILE_CACHE: the strategy names it
    if root is None:
        return None
    folder = None
    try:
        folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX)
        link = os.path.join(folder, "cache")
        if '"' in link or any(char.isspace() and char != " " for char in link):
            raise OSError(f"the temporary folder {folder!r} cannot go into TF_XLA_FLAGS")
        os.mkdir(os.path.join(folder, "scratch"), 0o700)
        os.symlink(os.path.join(folder, "scratch"), link)
    except OSError as exc:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        log.debug("tf_nvlink: no compile-cache link: %s", exc)
        return None
    _LINK.update(link=link, folder=folder)
    atexit.register(_remove, folder)
    environ["TF_XLA_FLAGS"] = compile_cache.with_cache_flags(current, link)
    return link


def point_link(target: Optional[str]) -> str:
    """Point this process's link at `target`, the strategy's context folder (for a folder this process cannot
    write, the private folder of links to its entries `compile_cache.prepare` made: TensorFlow read no read-only
    flag before the listing, and what it writes there stays there); None points it at a scratch folder (no program
    read, what TensorFlow writes is deleted with the process). The switch is atomic (a new link renamed over the
    old). Returns the folder the link now points at.

    Example:
        >>> point_link("/home/me/.cache/tf_nvlink/xla/3f0c9a1e22b4d5c6")
        '/home/me/.cache/tf_nvlink/xla/3f0c9a1e22b4d5c6'
    """
    if "link" not in _LINK:
        raise RuntimeError("point_link needs the link make_link puts in TF_XLA_FLAGS; this process has none "
                           "(compile_cache_link.current_link() is None)")
    folder = _LINK["folder"]
    if target is None:
        target = os.path.join(folder, "scratch")
    staged = os.path.join(folder, f"cache.{os.getpid()}.new")
    if os.path.lexists(staged):
        os.unlink(staged)
    os.symlink(target, staged)
    os.replace(staged, _LINK["link"])
    return target


def _remove(folder: str) -> None:
    # shutil.rmtree removes the links themselves, never what they point at
    shutil.rmtree(folder, ignore_errors=True)
