"""Waiting, bounded, until every other worker of a cluster accepts TCP connections (`wait_for_peers`), so a
missing or misaddressed worker is an error naming its address instead of a silent hang. Standard library only.

Example:
    >>> seconds = rendezvous.wait_for_peers(cluster.parse_tf_config(os.environ["TF_CONFIG"]), timeout_s=60)
"""

from __future__ import annotations

import math
import socket
import time
from typing import Optional

from tf_nvlink.machine.cluster_config import ClusterConfig, TfConfigError, split_address

DEFAULT_PEER_TIMEOUT_S = 60.0


class PeerUnreachableError(TimeoutError):
    """Some other worker did not accept a TCP connection within the timeout."""


def wait_for_peers(cluster: ClusterConfig, timeout_s: float = DEFAULT_PEER_TIMEOUT_S, *, listen: bool = True,
                   interval_s: float = 0.2) -> dict[str, float]:
    """Block until every other member of the all-reduce accepts a TCP connection; seconds each one took.

    While waiting, this worker listens on its own port (`listen`), so that workers started at the same time find
    each other before any of them starts TensorFlow's server, which would bind the same port (the listener is
    closed before this returns). A worker that already runs TensorFlow's server answers on that port too.

    Raises:
        PeerUnreachableError: naming each address that did not answer within `timeout_s`, and why.
        TfConfigError: this worker's own port is taken by another process.
    """
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0 \
            or math.isinf(timeout_s):
        raise ValueError(f"peer_timeout_s should be a positive number of seconds. Received: "
                         f"peer_timeout_s={timeout_s!r}")
    start = time.monotonic()
    deadline = start + timeout_s
    listener = _listen(cluster) if listen and cluster.worker_id is not None else None
    pending = dict(cluster.peers)  # task -> address
    reached: dict[str, float] = {}
    last_error: dict[str, str] = {}
    try:
        while True:
            for task, address in list(pending.items()):
                host, port = split_address(address)
                remaining = deadline - time.monotonic()
                try:
                    with socket.create_connection((host, port), timeout=max(0.05, min(2.0, remaining))):
                        pass
                except OSError as error:
                    last_error[task] = _describe(error)
                else:
                    reached[address] = round(time.monotonic() - start, 3)
                    del pending[task]
            _drain(listener)
            if not pending:
                return reached
            if time.monotonic() >= deadline:
                break
            time.sleep(max(0.0, min(interval_s, deadline - time.monotonic())))
    finally:
        if listener is not None:
            _drain(listener)
            listener.close()
    missing = "; ".join(f"{task} at {address} ({last_error.get(task, 'no answer')})"
                        for task, address in pending.items())
    raise PeerUnreachableError(
        f"{cluster.task} ({cluster.address}) could not reach {len(pending)} of its {len(cluster.peers)} peer(s) "
        f"within {timeout_s:g} s: {missing}. Start every task of the cluster ({cluster.source}) with its own "
        f"task index, check the host names, ports and firewalls, or wait longer (peer_timeout_s, --peer_timeout).")


def _listen(cluster: ClusterConfig) -> Optional[socket.socket]:
    _, port = split_address(cluster.address)
    try:
        if socket.has_dualstack_ipv6():
            listener = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=64)
        else:
            listener = socket.create_server(("", port), backlog=64)
    except OSError as error:
        raise TfConfigError(f"{cluster.task}'s own address {cluster.address} ({cluster.source}) cannot be used: port "
                            f"{port} is taken on this host ({_describe(error)}). Another process (an earlier run "
                            f"still alive?) holds it, or the task index names another task's port.") from None
    listener.setblocking(False)
    return listener


def _drain(listener: Optional[socket.socket]) -> None:
    """Accept and close whatever connections the peers' checks left queued."""
    while listener is not None:
        try:
            connection, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return
        connection.close()


def _describe(error: OSError) -> str:
    if isinstance(error, socket.gaierror):
        return f"host name does not resolve: {error.strerror or error}"
    if isinstance(error, (socket.timeout, TimeoutError)):
        return "no answer (connection timed out)"
    if isinstance(error, ConnectionRefusedError):
        return "connection refused: nothing listens on that port yet"
    return error.strerror or str(error) or type(error).__name__
