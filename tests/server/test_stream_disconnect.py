"""A streaming client that leaves while its request is still queued: nothing has been written to it
yet, so no failed write can tell. httplib's sink.is_writable() sees the hang-up (reviewed for issue 6:
the queued request is dropped at once, never admitted or prefilled for nobody); this guards it."""
from __future__ import annotations

import socket
import time

import pytest
from conftest import Server


@pytest.fixture(scope="module")
def one_slot(tiny_model, tmp_path_factory):
    s = Server(tiny_model, tmp_path_factory.mktemp("logs") / "serve.log", "--parallel", "1", "-c", "65536")
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.log.read_text()[-3000:]


def raw_post(port: int, body: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def wait_for(server, cond, what, timeout=20.0):
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        if cond(m):
            return m
        assert time.time() < deadline, f"{what}: {m}"
        time.sleep(0.01)


def test_streamed_client_leaving_the_queue_is_dropped_before_it_runs(one_slot):
    srv = one_slot
    before = srv.metrics()
    # The one running slot: a long non-streamed generation.
    blocker = raw_post(srv.port, b'{"prompt":"Tell me a long story","max_tokens":60000,"ignore_eos":true}')
    wait_for(srv, lambda m: m["kdtree_requests_running"] == 1, "the blocker never ran")
    queued = raw_post(srv.port, b'{"prompt":"Queued and then abandoned","max_tokens":8,"stream":true}')
    wait_for(srv, lambda m: m["kdtree_requests_waiting"] == 1, "the streamed request never queued")
    queued.close()
    t0 = time.time()
    after = wait_for(srv, lambda m: m["kdtree_requests_waiting"] == 0, "the abandoned request stayed queued", 5.0)
    assert time.time() - t0 < 2.0
    # Dropped from the queue, not run: the blocker still holds the only slot.
    assert after["kdtree_requests_running"] == 1
    assert after["kdtree_client_disconnects_total"] == before["kdtree_client_disconnects_total"] + 1
    blocker.close()
    wait_for(srv, lambda m: m["kdtree_requests_running"] == 0 and m["kdtree_kv_blocks_used"] == 0, "the blocker was not freed")
