"""tf_nvlink.plan.compile_cache_link: the per-process link TF_XLA_FLAGS names before TensorFlow lists its devices,
pointed at the strategy's context folder later; without TensorFlow. The process-level behaviour (an absl example
whose second run reads its programs back) is in tests/training/test_compile_cache_processes.py."""

import json
import os
import tempfile
import textwrap

import pytest

from conftest import run_python
from error_messages import raises_naming
from tf_nvlink.plan import compile_cache as cc
from tf_nvlink.plan import compile_cache_link


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """No link made yet in this process; temporary folders under tmp_path/tmp."""
    monkeypatch.setattr(compile_cache_link, "_LINK", {})
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return tmp_path


def test_the_link_goes_into_tf_xla_flags_once_and_points_at_an_empty_scratch_folder(fresh):
    environ = {"TF_XLA_FLAGS": "--tf_xla_auto_jit=2"}
    link = compile_cache_link.make_link(environ)
    assert link.startswith(str(fresh / "tmp" / compile_cache_link.FOLDER_PREFIX)) and os.path.islink(link)
    assert environ["TF_XLA_FLAGS"] == cc.with_cache_flags("--tf_xla_auto_jit=2", link)
    assert cc.users_cache_folder(environ["TF_XLA_FLAGS"]) is None  # recognised as tf_nvlink's own
    assert os.listdir(os.path.realpath(link)) == []
    assert compile_cache_link.make_link(environ) == link == compile_cache_link.current_link()


def test_no_link_when_the_cache_is_off_or_the_folder_is_the_users(fresh):
    off = {"TF_NVLINK_COMPILE_CACHE": "off"}
    users = {"TF_XLA_FLAGS": "--tf_xla_persistent_cache_directory=/mine"}
    assert compile_cache_link.make_link(off) is None and "TF_XLA_FLAGS" not in off
    assert compile_cache_link.make_link(users) is None
    assert users["TF_XLA_FLAGS"] == "--tf_xla_persistent_cache_directory=/mine"
    assert compile_cache_link.current_link() is None and list((fresh / "tmp").iterdir()) == []


def test_a_parents_flags_are_replaced_by_this_process_link(fresh):
    parent = cc.with_cache_flags("--tf_xla_auto_jit=2", "/parent/xla/0123abcd")
    environ = {"TF_XLA_FLAGS": parent}
    link = compile_cache_link.make_link(environ)
    assert cc.flag_value(environ["TF_XLA_FLAGS"], cc.FLAG_DIR) == link
    assert "/parent" not in environ["TF_XLA_FLAGS"] and "--tf_xla_auto_jit=2" in environ["TF_XLA_FLAGS"]


def test_pointing_the_link_moves_reads_and_writes_to_the_context_folder(fresh):
    link = compile_cache_link.make_link({})
    context = fresh / "cache" / "xla" / "0123abcd"
    context.mkdir(parents=True)
    assert compile_cache_link.point_link(str(context)) == str(context)
    (context / "tf_nvlink__1__2__XLA_CPU_JIT.pb").write_bytes(b"program")
    assert open(os.path.join(link, "tf_nvlink__1__2__XLA_CPU_JIT.pb"), "rb").read() == b"program"
    with open(os.path.join(link, "tf_nvlink__3__4__XLA_CPU_JIT.pb"), "wb") as handle:  # as TensorFlow writes one
        handle.write(b"new")
    assert sorted(os.listdir(context)) == ["tf_nvlink__1__2__XLA_CPU_JIT.pb", "tf_nvlink__3__4__XLA_CPU_JIT.pb"]

    scratch = compile_cache_link.point_link(None)  # the strategy's cache is off: nothing read, nothing kept
    assert os.path.realpath(link) == os.path.realpath(scratch) and os.listdir(link) == []


def test_a_read_only_folder_is_read_through_its_private_folder_of_links_and_written_nowhere_else(fresh):
    link = compile_cache_link.make_link({})
    context = fresh / "shared" / "0123abcd"
    context.mkdir(parents=True)
    (context / "tf_nvlink__1__2__XLA_CPU_JIT.pb").write_bytes(b"program")
    reading = cc.reading_folder(str(context))  # what prepare makes for a folder it cannot write
    assert compile_cache_link.point_link(reading) == reading and os.path.realpath(link) == os.path.realpath(reading)
    assert open(os.path.join(link, "tf_nvlink__1__2__XLA_CPU_JIT.pb"), "rb").read() == b"program"
    with open(os.path.join(link, "tf_nvlink__3__4__XLA_CPU_JIT.pb"), "wb") as handle:
        handle.write(b"new")
    assert os.listdir(context) == ["tf_nvlink__1__2__XLA_CPU_JIT.pb"]


def test_removing_the_link_folder_at_exit_keeps_the_entries_it_linked_to(fresh):
    link = compile_cache_link.make_link({})
    context = fresh / "cache" / "0123abcd"
    context.mkdir(parents=True)
    (context / "tf_nvlink__1__2__XLA_CPU_JIT.pb").write_bytes(b"program")
    compile_cache_link.point_link(cc.reading_folder(str(context)))
    compile_cache_link.point_link(str(context))
    compile_cache_link._remove(os.path.dirname(link))
    assert not os.path.lexists(os.path.dirname(link))
    assert (context / "tf_nvlink__1__2__XLA_CPU_JIT.pb").read_bytes() == b"program"


def test_pointing_without_a_link_is_an_error_naming_it(fresh):
    raises_naming(lambda: compile_cache_link.point_link("/c/xla/0123abcd"), "make_link", "current_link() is None",
                  error=RuntimeError)


ABSL_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from absl import app
    seen = []
    app.call_after_init(lambda: seen.append(os.environ.get("TF_XLA_FLAGS", "")))  # as TensorFlow's import does
    import tf_nvlink
    def main(argv):
        print(json.dumps({"at_init_callback": seen[0], "tensorflow": "tensorflow" in sys.modules}))
    app.run(main)
    """)


def test_import_tf_nvlink_names_the_link_before_absls_init_callbacks_and_removes_it_at_exit(tmp_path):
    """A script's `import tf_nvlink` after absl's app and before app.run: the link is in TF_XLA_FLAGS when absl's
    init callbacks run (TensorFlow's lists its devices there, reading the flags), even one registered before
    tf_nvlink was imported; TensorFlow is not imported; the link's folder is gone when the process has ended."""
    done = run_python(ABSL_SCRIPT, env={"TMPDIR": str(tmp_path), "TF_XLA_FLAGS": ""}, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    link = cc.flag_value(seen["at_init_callback"], cc.FLAG_DIR)
    assert link is not None and link.startswith(str(tmp_path / compile_cache_link.FOLDER_PREFIX)), seen
    assert seen["tensorflow"] is False
    assert list(tmp_path.iterdir()) == []

    off = run_python(ABSL_SCRIPT, env={"TMPDIR": str(tmp_path), "TF_XLA_FLAGS": "", "TF_NVLINK_COMPILE_CACHE": "off"},
                     timeout=60)
    assert json.loads(off.stdout.strip().splitlines()[-1])["at_init_callback"] == ""
