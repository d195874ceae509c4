import sys


def pytest_terminal_summary(terminalreporter):
    """The peer tier's runs (tests/peer/peer_runs.py), one line each, when its tests ran."""
    peer_runs = sys.modules.get("tests.peer.peer_runs")
    lines = peer_runs.summary_lines() if peer_runs is not None else []
    if lines:
        terminalreporter.section("peer tier: Keras' MirroredStrategy tests, stock and tf_nvlink")
        for line in lines:
            terminalreporter.write_line(line)
