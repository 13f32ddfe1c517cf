"""A request that reaches an idle mesh is taken at once, not after the other
ranks' doze: real ranks on the ring with a long --idle-interval, and the wake
channel's sockets (a connection without the generation's token is never woken)."""

import socket
import threading
import time

from kit.ranks import start_mesh
from runtime.wake import WakeHub, WakeLine, wake_token

IDLE = 1.0  # seconds the other ranks doze between exchanges once the mesh has idled 4x as long (1 s at most)


def test_a_request_to_an_idle_mesh_does_not_wait_out_the_other_ranks_doze(demo_model, tmp_path):
    with start_mesh(demo_model, 2, tmp_path, "--idle-interval", str(IDLE)) as mesh:
        mesh.wait_ready()
        assert "dozing ranks are woken by requests through 127.0.0.1:" in mesh.log(0)
        waits = []
        for _ in range(5):
            time.sleep(4 * IDLE + 0.5)  # the doze has grown to IDLE
            waits.append(mesh.first_token())
        # Unwoken, each would wait a uniform share of IDLE: four of five under a fifth of it by luck is 1 in 150.
        # One may be late on a busy machine (a CI run's took 0.202 s once).
        assert sorted(waits)[3] < IDLE / 5, waits


def test_only_a_line_with_the_generations_token_is_woken():
    token = wake_token("s3cret", 7)
    hub = WakeHub("127.0.0.1", token, loopback_only=False)
    stranger = socket.create_connection(("127.0.0.1", hub.port), timeout=5)
    stranger.sendall(wake_token("s3cret", 8))
    assert stranger.recv(1) == b""  # closed: another generation's token
    line = WakeLine("127.0.0.1", hub.port, token)
    woken = threading.Event()

    def wake_until_woken():  # a wake before the hub admitted the line reaches no one
        while not woken.wait(0.05):
            hub.wake()
    threading.Thread(target=wake_until_woken, daemon=True).start()
    t0 = time.monotonic()
    line.doze(30)
    woken.set()
    assert time.monotonic() - t0 < 10
