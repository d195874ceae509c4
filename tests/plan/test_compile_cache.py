"""tf_nvlink.plan.compile_cache: the folder, the flags, the context key, and the care of the entries (bad ones
dropped with one warning, the size bound, clear), without TensorFlow. The process-level behaviour (a second
process reads what the first compiled) is in tests/training/test_compile_cache_processes.py."""

import os

from error_messages import raises_naming
from tf_nvlink.plan import compile_cache as cc


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, payload) -> bytes:
    if isinstance(payload, int):
        return varint(number << 3) + varint(payload)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def entry_bytes(signature=123, cluster=456, device="XLA_CPU_JIT", program=b"x" * 100) -> bytes:
    """An XlaSerializedCacheEntry as TensorFlow writes one (key, HLO module, executable)."""
    key = field(1, signature) + field(2, cluster) + field(3, device.encode()) + field(4, b"tf_nvlink")
    return field(1, key) + field(2, b"hlo" * 10) + field(3, program)


def write_entry(folder, signature=123, cluster=456, device="XLA_CPU_JIT", mtime=None, **kwargs) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"tf_nvlink__{signature}__{cluster}__{device}.pb")
    with open(path, "wb") as handle:
        handle.write(entry_bytes(signature, cluster, device, **kwargs))
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_settings():
    assert cc.validate_setting("auto") == "auto" and cc.validate_setting(" OFF ") == "off"
    assert cc.validate_setting(None) == "off" and cc.validate_setting(False) == "off"
    assert cc.validate_setting("rel/dir") == os.path.abspath("rel/dir")
    for bad in ("", 3, True, ["auto"]):
        raises_naming(lambda bad=bad: cc.validate_setting(bad), repr(bad), "'auto'", "'off'")


def test_root_folder_follows_the_tune_cache_and_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TF_NVLINK_CACHE_DIR", str(tmp_path))
    assert cc.root_folder("auto", {}) == str(tmp_path / "xla")
    assert cc.root_folder("auto", {cc.ENV_SETTING: "off"}) is None
    assert cc.root_folder("auto", {cc.ENV_SETTING: "/elsewhere"}) == "/elsewhere"
    assert cc.root_folder("off", {}) is None and cc.root_folder("/mine", {cc.ENV_SETTING: "off"}) == "/mine"


def test_flags_are_replaced_not_stacked_and_a_users_folder_is_recognised():
    ours = cc.with_cache_flags("--tf_xla_auto_jit=2", "/c/xla/k1")
    assert ours == ("--tf_xla_auto_jit=2 --tf_xla_persistent_cache_directory=/c/xla/k1 "
                    "--tf_xla_persistent_cache_prefix=tf_nvlink")
    again = cc.with_cache_flags(ours, "/c/xla/k2", read_only=True)
    assert again.count(cc.FLAG_DIR) == 1 and "/c/xla/k2" in again and f"{cc.FLAG_READ_ONLY}=true" in again
    assert cc.users_cache_folder(ours) is None  # an inherited tf_nvlink flag is not the user's
    assert cc.users_cache_folder("--tf_xla_persistent_cache_directory=/mine") == "/mine"
    assert cc.without_cache_flags(again) == "--tf_xla_auto_jit=2"


def test_context_key_changes_with_what_entries_names_leave_out():
    base = dict(tf_version="2.21.0", tf_nvlink_version="0.1.0", xla_flags="", tf_xla_flags="")
    key = cc.context_key(**base)
    assert len(key) == 16 and key == cc.context_key(**base)
    # the cache's own flags do not count; every other flag does
    assert cc.context_key(**dict(base, tf_xla_flags=cc.with_cache_flags("", "/x"))) == key
    others = [dict(base, tf_version="2.22.0"), dict(base, tf_nvlink_version="0.2.0"),
              dict(base, xla_flags="--xla_gpu_enable_latency_hiding_scheduler=true"),
              dict(base, tf_xla_flags="--tf_xla_auto_jit=2"),
              dict(base, gpu_names=["NVIDIA H200"], driver_version="570.1"),
              dict(base, gpu_names=["NVIDIA H100"], driver_version="570.1"),
              dict(base, gpu_names=["NVIDIA H200"], driver_version="575.0"),
              dict(base, request=cc.request_text(xla_flags="none")),
              dict(base, request=cc.request_text(gpus=[0, 1]))]
    keys = {cc.context_key(**other) for other in others}
    assert len(keys) == len(others) and key not in keys


def test_a_sound_entry_passes_and_bad_ones_are_named(tmp_path):
    good = write_entry(tmp_path)
    assert cc.entry_problem(good) is None
    truncated = write_entry(tmp_path, signature=1)
    with open(truncated, "r+b") as handle:
        handle.truncate(os.path.getsize(truncated) - 5)
    garbage = os.path.join(tmp_path, "tf_nvlink__2__3__XLA_CPU_JIT.pb")
    with open(garbage, "wb") as handle:
        handle.write(os.urandom(64) + b"\xff" * 16)
    renamed = os.path.join(tmp_path, "tf_nvlink__9__456__XLA_CPU_JIT.pb")
    with open(renamed, "wb") as handle:
        handle.write(entry_bytes())
    other_prefix = os.path.join(tmp_path, "xla_compile_cache__123__456__XLA_CPU_JIT.pb")
    with open(other_prefix, "wb") as handle:
        handle.write(entry_bytes())  # its key says prefix "tf_nvlink"
    empty = os.path.join(tmp_path, "tf_nvlink__4__5__XLA_GPU_JIT.pb")
    open(empty, "wb").close()
    assert "past the end" in cc.entry_problem(truncated)
    assert cc.entry_problem(garbage).startswith("not an XLA cache entry")
    assert "file name" in cc.entry_problem(renamed) and "file name" in cc.entry_problem(other_prefix)
    assert "missing" in cc.entry_problem(empty)
    dropped = dict(cc.drop_bad_entries(str(tmp_path)))
    assert set(dropped) == {truncated, garbage, renamed, other_prefix, empty}
    assert [entry.path for entry in cc.entries(str(tmp_path))] == [good]


def test_evict_oldest_first_across_contexts_and_clear(tmp_path):
    root = str(tmp_path)
    paths = [write_entry(os.path.join(root, context), signature=i, mtime=1000 + i)
             for i, context in enumerate(["old", "new", "new", "new"])]
    size = os.path.getsize(paths[0])
    removed = cc.evict(root, max_bytes=2 * size)
    assert [entry.path for entry in removed] == paths[:2]
    assert not os.path.exists(os.path.join(root, "old"))  # its folder left empty is removed
    assert [entry.path for entry in cc.entries(root)] == paths[2:]
    raises_naming(lambda: cc.evict(root, max_bytes=-1), "-1")
    assert cc.clear(root) == (2, 2 * size) and os.listdir(root) == []


def test_prepare_sets_the_flags_and_drops_a_bad_entry_with_one_warning(tmp_path, caplog):
    environ = {"TF_NVLINK_CACHE_DIR": str(tmp_path), "TF_XLA_FLAGS": "--tf_xla_auto_jit=2"}
    folder = os.path.join(tmp_path, "mine", "k")
    write_entry(folder)
    with open(os.path.join(folder, "tf_nvlink__7__8__XLA_CPU_JIT.pb"), "wb") as handle:
        handle.write(b"garbage")
    with caplog.at_level("WARNING", logger="tf_nvlink"):
        state = cc.prepare(str(tmp_path / "mine"), "k", environ)
    assert state.active and state.folder == folder and state.dropped == 1
    assert len(caplog.records) == 1 and "tf_nvlink__7__8__XLA_CPU_JIT.pb" in caplog.text
    assert environ["TF_XLA_FLAGS"] == cc.with_cache_flags("--tf_xla_auto_jit=2", folder)
    assert "1 entry" in state.note


def test_prepare_respects_the_users_flag_and_off(tmp_path, caplog):
    environ = {"TF_XLA_FLAGS": "--tf_xla_persistent_cache_directory=/theirs"}
    with caplog.at_level("INFO", logger="tf_nvlink"):
        state = cc.prepare("auto", "k", environ)
    assert state.users and state.folder == "/theirs" and "keeps it" in caplog.text
    assert environ["TF_XLA_FLAGS"] == "--tf_xla_persistent_cache_directory=/theirs"
    inherited = {"TF_XLA_FLAGS": cc.with_cache_flags("", "/parent/k")}
    assert not cc.prepare("off", "k", inherited).active and "TF_XLA_FLAGS" not in inherited


def test_a_folder_with_spaces_is_quoted_and_one_with_a_quote_refused(tmp_path, caplog):
    environ = {"TF_XLA_FLAGS": "--tf_xla_auto_jit=2"}
    state = cc.prepare(str(tmp_path / "with space"), "k", environ)
    folder = str(tmp_path / "with space" / "k")
    assert state.active and state.folder == folder
    assert f'{cc.FLAG_DIR}="{folder}"' in environ["TF_XLA_FLAGS"]
    assert cc.flag_value(environ["TF_XLA_FLAGS"], cc.FLAG_DIR) == folder
    assert cc.without_cache_flags(environ["TF_XLA_FLAGS"]) == "--tf_xla_auto_jit=2"
    environ = {}
    with caplog.at_level("WARNING", logger="tf_nvlink"):
        state = cc.prepare(str(tmp_path / 'quo"te'), "k", environ)
    assert not state.active and "double quote" in caplog.text and environ == {}


def test_prepare_unwritable_folder_warns_once_naming_it_and_reads_it(tmp_path, caplog, monkeypatch):
    folder = tmp_path / "locked" / "k"
    write_entry(folder)

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cc.tempfile, "mkstemp", refuse)  # as a chmod 500 folder does (root ignores chmod)
    environ = {}
    with caplog.at_level("WARNING", logger="tf_nvlink"):
        state = cc.prepare(str(tmp_path / "locked"), "k", environ)
    assert len(caplog.records) == 1 and str(folder) in caplog.text and "Permission denied" in caplog.text
    # read through a private folder of links (a link can be dropped later; the folder itself never changes)
    assert state.read_only and state.source == str(folder) and state.folder != str(folder)
    assert os.listdir(state.folder) == os.listdir(folder)
    assert os.path.realpath(os.path.join(state.folder, os.listdir(folder)[0])) == str(folder / os.listdir(folder)[0])
    assert environ["TF_XLA_FLAGS"] == cc.with_cache_flags("", state.folder, read_only=True)


def test_prepare_folder_that_cannot_be_created_goes_uncached(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    environ = {}
    with caplog.at_level("WARNING", logger="tf_nvlink"):
        state = cc.prepare(str(blocker), "k", environ)
    assert not state.active and environ == {} and len(caplog.records) == 1
    assert str(blocker / "k") in caplog.text and "training goes on uncached" in caplog.text


def test_request_text_names_what_chooses_tf_nvlinks_xla_flags():
    assert cc.request_text() == "gpus='all' devices=None xla_allreduce='auto' xla_flags='auto'"
    assert cc.request_text(gpus=(0, 1)) == cc.request_text(gpus=[0, 1])
    assert cc.request_text(gpus=" AUTO ") == cc.request_text(gpus="auto")


def test_prepare_process_keys_on_this_machine_without_tensorflow(tmp_path):
    from tf_nvlink.machine.topology import Topology

    environ = {}
    state = cc.prepare_process(str(tmp_path), cc.request_text(), Topology(), environ)
    again = cc.prepare_process(str(tmp_path), cc.request_text(), Topology(), dict(environ))
    assert state.folder == again.folder and os.path.dirname(state.folder) == str(tmp_path)
    other = cc.prepare_process(str(tmp_path), cc.request_text(), Topology(), {"XLA_FLAGS": "--xla_dump_to=/x"})
    assert other.folder != state.folder


def test_stale_temporaries_of_killed_writers_go(tmp_path):
    folder = tmp_path / "ctx"
    folder.mkdir()
    old, fresh = folder / "tf_nvlink__1__2__XLA_GPU_JIT.pb.123.pb.tmp", folder / "tf_nvlink__3__4__XLA_GPU_JIT.pb.tmp"
    for path in (old, fresh):
        path.write_bytes(b"partial")
    os.utime(old, (1000, 1000))
    assert cc.drop_stale_temporaries(str(tmp_path)) == 1
    assert not old.exists() and fresh.exists()
    assert cc.entries(str(tmp_path)) == []  # a temporary is never taken for an entry


def test_the_users_folder_with_a_bad_entry_is_read_through_links_and_never_changed(tmp_path, caplog):
    users = tmp_path / "mine"
    good = write_entry(users, signature=1)
    bad = write_entry(users, signature=2)
    os.truncate(bad, 20)
    before = sorted(os.listdir(users))
    environ = {"TF_XLA_FLAGS": f"--tf_xla_auto_jit=2 {cc.FLAG_DIR}={users} {cc.FLAG_PREFIX}=tf_nvlink_user"}
    with caplog.at_level("WARNING", logger="tf_nvlink"):
        state = cc.prepare("auto", "k", environ)
    assert state.users and state.read_only and state.source == str(users) and state.skipped[0][0] == bad
    assert os.listdir(state.folder) == [os.path.basename(good)] and sorted(os.listdir(users)) == before
    assert cc.flag_value(environ["TF_XLA_FLAGS"], cc.FLAG_DIR) == state.folder
    assert cc.flag_value(environ["TF_XLA_FLAGS"], cc.FLAG_READ_ONLY) == "true"
    assert cc.flag_value(environ["TF_XLA_FLAGS"], cc.FLAG_PREFIX) == "tf_nvlink_user"  # the user's, kept
    assert "--tf_xla_auto_jit=2" in environ["TF_XLA_FLAGS"]
    assert len(caplog.records) == 1 and os.path.basename(bad) in caplog.text and "does not change" in caplog.text
    # prepared again in the same process (the facade, then the strategy): the same private folder, no new warning
    again = cc.prepare("auto", "k", environ)
    assert again.folder == state.folder and again.source == str(users) and len(caplog.records) == 1
    # damaged after that: `recheck` drops its link, the user's file stays
    with open(good, "r+b") as handle:
        handle.truncate(10)
    assert [action[:8] for _, _, action in cc.recheck(again)] == ["not read"]
    assert os.listdir(state.folder) == [] and sorted(os.listdir(users)) == before


def test_the_users_folder_read_by_tensorflow_before_tf_nvlink_is_named_not_changed(tmp_path, caplog):
    users = tmp_path / "mine"
    bad = write_entry(users, signature=2)
    os.truncate(bad, 0)
    environ = {"TF_XLA_FLAGS": f"{cc.FLAG_DIR}={users}"}
    with caplog.at_level("WARNING", logger="tf_nvlink"):
        state = cc.prepare("auto", "k", environ, tensorflow_started=True)
    assert state.folder == str(users) and state.users and state.source is None and os.path.exists(bad)
    assert environ == {"TF_XLA_FLAGS": f"{cc.FLAG_DIR}={users}"}
    assert "reads them itself" in caplog.text and os.path.basename(bad) in caplog.text
    assert cc.recheck(state) == []  # named already: not again


def test_tensorflow_started_without_the_flag_says_the_line_that_fixes_it(tmp_path, monkeypatch):
    """A notebook that ran `tf.config.list_physical_devices("GPU")` before the strategy: the note says what to call
    first, in a notebook's terms too, and the value to export."""
    monkeypatch.setenv("TF_XLA_FLAGS", f"{cc.FLAG_DIR}={tmp_path}")
    state = cc.what_tensorflow_read(cc.prepare(str(tmp_path), "k", {}), None)
    assert state.folder is None and not state.active
    assert "call tf_nvlink.strategy() before any tf.config call or TensorFlow op" in state.note
    assert "in a notebook: restart the kernel, then build the strategy in the first cell" in state.note
    assert f"export TF_XLA_FLAGS='{cc.FLAG_DIR}={tmp_path}' before Python starts" in state.note
    assert "\n" not in state.note


def test_recheck_deletes_from_tf_nvlinks_own_folder_only(tmp_path):
    own = cc.prepare(str(tmp_path / "cache"), "k", {})
    entry = write_entry(own.folder)
    os.truncate(entry, 7)
    (path, problem, action), = cc.recheck(own)
    assert path == entry and "not an XLA cache entry" in problem and action.startswith("deleted")
    assert not os.path.exists(entry)
    theirs = tmp_path / "theirs"
    entry = write_entry(theirs)
    os.truncate(entry, 7)
    users = cc.CacheState("auto", str(theirs), users=True)
    assert cc.recheck(users)[0][2].startswith("left in place") and os.path.exists(entry)
    assert cc.recheck(cc.CacheState("off", None)) == [] and cc.recheck(None) == []


def test_a_read_failure_names_the_entry_and_what_to_do(tmp_path):
    message = "Graph execution error:\n\n2 root error(s) found.\n  (0) OUT_OF_RANGE:  Read less bytes than requested"
    own = cc.prepare(str(tmp_path / "cache"), "k", {})
    entry = write_entry(own.folder)
    os.truncate(entry, 7)
    error = cc.read_failure(own, message)
    assert isinstance(error, cc.CompileCacheError)
    text = str(error)
    assert "'Read less bytes than requested'" in text and os.path.basename(entry) in text
    assert "deleted now: run again" in text and not os.path.exists(entry)  # the next run compiles it again
    users = tmp_path / "theirs"
    entry = write_entry(users)
    os.truncate(entry, 7)
    text = str(cc.read_failure(cc.CacheState("auto", str(users), users=True), message))
    assert "does not change that folder" in text and entry in text and os.path.exists(entry)
    locked = cc.CacheState("auto", "/tmp/x", read_only=True, source=str(users))
    assert f"{cc.CLEAR_COMMAND} --dir {tmp_path}" in str(cc.read_failure(locked, message))
    # not the cache: no entry damaged and TensorFlow's text does not point at it; the cache off
    elsewhere = cc.read_failure(own, "OUT_OF_RANGE: StopIteration")
    assert type(elsewhere) is RuntimeError and "does not point at it" in str(elsewhere)
    off = cc.read_failure(cc.CacheState("off", None), message)
    assert type(off) is RuntimeError and "is off in this process" in str(off)


def test_the_cause_of_a_tensorflow_error_is_its_root_line():
    assert cc.tensorflow_cause("Graph execution error:\n\n2 root error(s) found.\n  (0) OUT_OF_RANGE:  Read less "
                               "bytes than requested\n\t [[{{node a}}]]\n  (1) CANCELLED: x") == \
        "Read less bytes than requested"
    assert cc.tensorflow_cause("Graph execution error:\n\nDetected at node a defined at (most recent call last):\n"
                               "<stack traces unavailable>\nStopIteration\n\t [[{{node a}}]] [Op:f]") == "StopIteration"
    assert cc.tensorflow_cause("End of sequence") == "End of sequence" and cc.tensorflow_cause("") == ""
