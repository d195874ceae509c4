"""`tf-nvlink cache`: the persistent XLA compile cache (`tf_nvlink.plan.compile_cache`): where it is, its context
folders, entries and size; `--clear` empties it. No TensorFlow import.

    tf-nvlink cache                 # folder, entries and size per context
    tf-nvlink cache --json          # the same as JSON
    tf-nvlink cache --clear         # delete every entry (the next fit compiles again)
    tf-nvlink cache --dir /scratch/xla   # a folder given as compile_cache=... (its context folders)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

from tf_nvlink.plan import compile_cache
from tf_nvlink.util.text_table import table

HELP = "the persistent XLA compile cache: folder, entries and size; --clear empties it"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `tf-nvlink cache` options."""
    parser.add_argument("--dir", default=None, type=_cache_folder,
                        help="the cache folder (default: the one compile_cache='auto' uses: "
                             "$TF_NVLINK_CACHE_DIR/xla, else ~/.cache/tf_nvlink/xla)")
    parser.add_argument("--clear", action=argparse.BooleanOptionalAction, default=False,
                        help="delete every entry and context folder")
    parser.add_argument("--json", action=argparse.BooleanOptionalAction, default=False,
                        help="print JSON instead of text")


def _cache_folder(text: str) -> str:
    """`--dir`: a folder, or a path that does not exist yet; not a file."""
    path = os.path.abspath(os.path.expanduser(text)) if text.strip() else ""
    if not path or os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"should be a folder (or a path that does not exist yet), not a file. "
                                         f"Received: {text!r}")
    return path


def run(args: argparse.Namespace) -> int:
    """`tf-nvlink cache`: list (or clear) the cache; 0 also when it does not exist yet."""
    root = args.dir
    cleared = None
    if args.clear:
        target = root if root is not None else compile_cache.root_folder("auto")
        if target is not None:
            count, size = compile_cache.clear(target)
            cleared = {"entries": count, "bytes": size}
    data = compile_cache.summary(root)
    if cleared is not None:
        data["cleared"] = cleared
    print(json.dumps(data, indent=1) if args.json else render_text(data))
    return 0


def render_text(data: dict) -> str:
    lines = []
    if "cleared" in data:
        lines.append(f"cleared {data['cleared']['entries']} entries, {data['cleared']['bytes'] / 2**20:.1f} MiB")
    lines.append(compile_cache.summary_line(data))
    if data.get("contexts"):
        rows = [["context", "entries", "MiB", "newest entry"]]
        for context in data["contexts"]:
            newest = context["newest"]
            rows.append([context["context"], str(context["entries"]), f"{context['bytes'] / 2**20:.1f}",
                         datetime.datetime.fromtimestamp(newest).isoformat(timespec="seconds") if newest else "-"])
        lines += table(rows, right={1, 2}, header_rows=1)
    elif data.get("enabled"):
        lines.append("(empty: the first jit-compiled fit under tf_nvlink.strategy() fills it)")
    return "\n".join(lines)


__all__ = ["HELP", "add_arguments", "run", "render_text"]
