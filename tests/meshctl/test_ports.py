"""The port picker, on real sockets: a port that a stopped server's connections hold in TIME_WAIT is free
(so `meshctl down` then `up` keeps the demo's URLs), a port a live socket holds is not."""

import socket

import psutil
import pytest

from kit.waiting import wait_for
from meshd.meshctl.ports import SPAN, free_run, run_free, span


def server() -> socket.socket:
    """A listener as meshd's servers bind theirs (SO_REUSEADDR), on a port of the kernel's choosing."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def served_once(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    """A client connected to `listener`, and the server's end of that connection."""
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    return client, accepted


def states(port: int) -> set[str]:
    return {c.status for c in psutil.net_connections("tcp") if c.laddr.port == port}


def test_a_port_whose_server_stopped_is_free_again_while_its_connections_are_in_time_wait():
    listener = server()
    port = listener.getsockname()[1]
    client, accepted = served_once(listener)
    accepted.close()  # the server closes first, as a stopping server does: its end waits in TIME_WAIT
    listener.close()
    client.close()
    wait_for(lambda: states(port) == {psutil.CONN_TIME_WAIT}, 10, "the server's end in TIME_WAIT")
    assert run_free(port, 1)
    assert free_run(1, preferred=port) == port


def test_a_port_a_live_socket_holds_is_taken():
    listener = server()
    port = listener.getsockname()[1]
    try:
        assert not run_free(port, 1)  # listening
        client, accepted = served_once(listener)
        listener.close()  # as the ring's listener does once its peer connected: the connection holds the port
        with client, accepted:
            assert states(port) == {psutil.CONN_ESTABLISHED}
            assert not run_free(port, 1) and free_run(1, preferred=port) != port
    finally:
        listener.close()


@pytest.mark.parametrize("taken_offset", [0, 2])
def test_a_run_is_free_only_when_each_of_its_ports_is(taken_offset):
    base = free_run(3)
    assert not run_free(base, 3, taken={base + taken_offset})
    with server() as s:
        assert not run_free(s.getsockname()[1] - taken_offset, 3)


@pytest.mark.parametrize("value,expected", [
    (None, SPAN), ("", SPAN),  # unset: below Linux's ephemeral range
    ("20000-26000", (20000, 26000)),
    ("26000-20000", "no span of ports"), ("80-9000", "no span of ports"), ("20000", "no span of ports"),
    ("a-b", "no span of ports"), ("20000-70000", "no span of ports"),
])
def test_the_span_random_runs_come_from_is_checked_with_its_fix(value, expected):
    if isinstance(expected, tuple):
        assert span(value) == expected
        return
    with pytest.raises(ValueError, match=expected) as refused:
        span(value)
    assert "LOW-HIGH" in str(refused.value)


def test_a_process_picks_only_in_its_span(monkeypatch):
    monkeypatch.setenv("MESHD_PORT_SPAN", "23000-23100")
    bases = [free_run(2) for _ in range(10)]
    assert all(23000 <= b and b + 2 <= 23100 for b in bases) and len(set(bases)) == 10
