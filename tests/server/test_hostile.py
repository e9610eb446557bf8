"""A hostile client must never crash, stall or balloon the server (issue 21). Each case here failed on
main @ 5e183dd (cpp-httplib 0.11.4): deep JSON killed the process (SIGSEGV in nlohmann's recursive
dump), gzip and chunked bodies went past --max-body, headers were buffered without limit, 110
trickling connections took every worker, a trickling client held the process past SIGTERM.

The table at the top is raw HTTP (what no well-behaved client sends); after every case the server
must still answer /health and a real request. The load test at the bottom mixes good, bad, slow and
cancelled clients and checks that RSS, threads and descriptors stay flat
(KDTREE_HOSTILE_SECONDS, default 45; 600 for the full-length run).
"""
from __future__ import annotations

import gzip
import json
import os
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from conftest import Server

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "Hi"}]
DEEP = 100_000  # levels; ≈ 200 KB of brackets


def nest(n: int, inner: str = "1") -> str:
    return "[" * n + inner + "]" * n


def raw(port: int, data: bytes, timeout: float = 10.0, read_all: bool = True) -> bytes:
    """Sends bytes on a fresh connection and returns what comes back until the server closes it (or
    the first response when read_all is False)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(timeout)
    try:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before reading everything: read what it said
        out = b""
        while True:
            try:
                more = s.recv(65536)
            except ConnectionResetError:
                break
            if not more:
                break
            out += more
            if not read_all and b"\r\n\r\n" in out:
                head, _, body = out.partition(b"\r\n\r\n")
                n = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
                if n and len(body) >= n[0]:
                    break
        return out
    finally:
        s.close()


def status_of(resp: bytes) -> int:
    assert resp.startswith(b"HTTP/1.1 "), resp[:200]
    return int(resp.split(b" ", 2)[1])


def error_of(resp: bytes) -> dict:
    body = resp.partition(b"\r\n\r\n")[2]
    return json.loads(body)["error"]


def post_bytes(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{extra}Connection: close\r\n\r\n").encode() + body


def still_serving(s: Server):
    assert s.request("GET", "/health", timeout=10)[0] == 200
    status, _, r = s.post(COMP, {"prompt": "ok", "max_tokens": 2})
    assert status == 200, r


@dataclass
class Req:
    id: str
    data: bytes
    status: int
    message: str = ""  # a substring of the error message


def deep_cases() -> list[Req]:
    d = nest(DEEP)
    return [
        Req("messages-nested", post_bytes(CHAT, ('{"messages": ' + d + "}").encode()), 400, "nests deeper"),
        Req("content-nested", post_bytes(CHAT, ('{"messages": [{"role": "user", "content": ' + d + "}]}").encode()), 400, "nests deeper"),
        Req("tool-parameters-nested", post_bytes(CHAT, json.dumps({"messages": MSGS, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": "@"}}}]}).replace('"@"', d).encode()), 400, "nests deeper"),
        Req("extra-field-nested", post_bytes(COMP, ('{"prompt": "a", "metadata": ' + nest(DEEP, "{}") + "}").encode()), 400, "nests deeper"),
        Req("objects-nested", post_bytes(CHAT, ('{"messages": ' + '{"a":' * DEEP + "1" + "}" * DEEP + "}").encode()), 400, "nests deeper"),
        Req("tokenize-nested", post_bytes("/tokenize", ('{"content": "a", "x": ' + d + "}").encode()), 400, "nests deeper"),
        Req("tokenize-messages-nested", post_bytes("/tokenize", ('{"messages": ' + d + "}").encode()), 400, "nests deeper"),
        Req("detokenize-nested", post_bytes("/detokenize", ('{"tokens": ' + d + "}").encode()), 400, "nests deeper"),
        Req("huge-number", post_bytes(COMP, b'{"prompt": "a", "max_tokens": 1e999}'), 400, ""),
        Req("huge-integer", post_bytes(COMP, b'{"prompt": "a", "max_tokens": 123456789012345678901234567890}'), 400, ""),
    ]


def protocol_cases() -> list[Req]:
    big = json.dumps({"prompt": "a" * 1000}).encode()
    gz = gzip.compress(big)
    return [
        Req("gzip-body", post_bytes(COMP, gz, "Content-Encoding: gzip\r\n"), 415, "Content-Encoding"),
        Req("deflate-body", post_bytes(COMP, gz, "Content-Encoding: deflate\r\n"), 415, "Content-Encoding"),
        Req("unknown-transfer-coding", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
            501, "Transfer-Encoding"),
        Req("negative-length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", 400, "malformed"),
        Req("huge-length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000000000000000\r\n\r\n", 400, ""),
        Req("length-over-limit", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n", 413, "size limit"),
        Req("two-lengths", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400, ""),
        Req("long-request-line", b"GET /" + b"a" * (1 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431, "headers exceed"),
        Req("many-headers", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 8000) for i in range(64))
            + b"\r\n", 431, "headers exceed"),
        Req("garbage", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)) + b"\r\n\r\n", 400, "malformed"),
        Req("bad-method", b"BREW /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405, "not allowed"),
        Req("get-on-post-route", b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405, "not allowed"),
        Req("no-route", b"GET /nowhere/%00%ff HTTP/1.1\r\nHost: x\r\n\r\n", 404, "no route"),
        Req("tokenize-bad-messages", post_bytes("/tokenize", b'{"messages": []}'), 400, "'messages' is empty"),
        Req("tokenize-bad-content", post_bytes("/tokenize", b'{"content": 5}'), 400, "'content'"),
        Req("detokenize-bad-id", post_bytes("/detokenize", b'{"tokens": [1, -3]}'), 400, "tokens[1]"),
        Req("strict-tool-unsupported-schema", post_bytes(CHAT, json.dumps({"messages": MSGS, "tools": [{"type": "function", "function": {
            "name": "f", "strict": True, "parameters": {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 1}}}}}}]}).encode()),
            400, "$.properties.n.not: not supported"),
    ]


@pytest.mark.parametrize("case", deep_cases() + protocol_cases(), ids=lambda c: c.id)
def test_hostile_request(server, case):
    t0 = time.time()
    resp = raw(server.port, case.data)
    assert time.time() - t0 < 5, "answered promptly, not after a timeout"
    assert status_of(resp) == case.status, resp[:400]
    if case.message:
        assert case.message in error_of(resp)["message"], resp[:400]
    assert server.proc.poll() is None
    still_serving(server)


def test_chunked_body_over_the_limit_is_refused_early(tiny_model, tmp_path):
    """A chunked body is counted as it arrives: 413 at the limit, not after reading 256 MB."""
    s = Server(tiny_model, tmp_path / "serve.log", "--max-body", "1")
    try:
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.settimeout(10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (65536, b"a" * 65536)
        sent = 0
        try:
            while sent < (256 << 20):
                sock.sendall(chunk)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        resp = b""
        try:
            while True:
                more = sock.recv(65536)
                if not more:
                    break
                resp += more
        except (ConnectionResetError, socket.timeout):
            pass
        # 1 MiB read + at most 4 MiB discarded while lingering + what the loopback buffers hold.
        assert sent < (32 << 20), f"the server took {sent} bytes of a body limited to 1 MiB"
        if resp:  # the reset can beat the answer to the client; the size read is what matters
            assert status_of(resp) == 413, resp[:300]
        still_serving(s)
    finally:
        s.stop()


def test_chunked_body_within_the_limit_is_served(server):
    body = json.dumps({"prompt": "chunked", "max_tokens": 2}).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    resp = raw(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
               + chunks + b"0\r\n\r\n")
    assert status_of(resp) == 200, resp[:300]


def test_expect_100_continue(server):
    """curl sends large bodies after 'Expect: 100-continue' and waits for the interim answer."""
    body = json.dumps({"prompt": "continue", "max_tokens": 2}).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    s.settimeout(10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nConnection: close\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n")
    assert s.recv(1024).startswith(b"HTTP/1.1 100 Continue")
    s.sendall(body)
    resp = b""
    while (more := s.recv(65536)):
        resp += more
    s.close()
    assert status_of(resp) == 200


def test_http10_stream_ends_with_close(server):
    """HTTP/1.0 has no chunked coding: an SSE answer is the raw events, ended by the close."""
    body = json.dumps({"prompt": "old client", "max_tokens": 3, "stream": True}).encode()
    resp = raw(server.port, b"POST /v1/completions HTTP/1.0\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    head, _, rest = resp.partition(b"\r\n\r\n")
    assert status_of(resp) == 200 and b"chunked" not in head.lower()
    assert rest.rstrip().endswith(b"data: [DONE]")


def test_bearer_scheme_is_case_insensitive(tiny_model, tmp_path):
    s = Server(tiny_model, tmp_path / "serve.log", "--api-key", "sekret")
    try:
        for auth, ok in [("Bearer sekret", True), ("bearer sekret", True), ("BEARER sekret", True), ("Bearer   sekret ", True),
                         ("Bearer sekret2", False), ("Basic sekret", False), ("Bearersekret", False), ("bearer", False)]:
            status, _, _ = s.request("GET", "/v1/models", headers={"Authorization": auth})
            assert status == (200 if ok else 401), auth
    finally:
        s.stop()


def trickle(port: int, stop: threading.Event, payload: bytes = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):
    """One slowloris connection: a byte a second until told to stop or dropped."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError:
        return
    try:
        i = 0
        while not stop.is_set():
            s.send(payload[i % len(payload):i % len(payload) + 1] if i < len(payload) else b"X-a: b\r\n"[:1])
            i += 1
            stop.wait(1.0)
    except OSError:
        pass
    finally:
        s.close()


def test_slowloris_does_not_starve_good_clients(tiny_model, tmp_path):
    """150 connections trickling a byte a second (more than every HTTP worker): /health and real
    requests are answered promptly throughout, and each trickler is dropped at its header deadline."""
    s = Server(tiny_model, tmp_path / "serve.log", "--threads-http", "16", "--header-timeout", "4")
    stop = threading.Event()
    threads = [threading.Thread(target=trickle, args=(s.port, stop), daemon=True) for _ in range(150)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.5)
        for _ in range(5):
            t0 = time.time()
            still_serving(s)
            assert time.time() - t0 < 3
            time.sleep(0.5)
        # Past the header deadline every trickler has been dropped (its thread ends on the error).
        time.sleep(4)
        stop.set()
        for t in threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in threads)
    finally:
        stop.set()
        s.stop()


def test_connection_cap_refuses_fast(tiny_model, tmp_path):
    # Idle connections must stay open while we knock: a slow (sanitized, loaded) server must not
    # close them at the 1 s test idle timeout before the 21st arrives.
    s = Server(tiny_model, tmp_path / "serve.log", "--max-connections", "20", idle_timeout=60)
    socks = []

    def held():
        """A connection that answered a request and stays open (keep-alive), or None if refused."""
        c = socket.create_connection(("127.0.0.1", s.port), timeout=30)
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while b'{"status":"ok"}' not in got:
            chunk = c.recv(4096)
            if not chunk:
                c.close()
                assert b"too many open connections" in got, f"the server closed a connection under the cap: {got!r}"
                return None
            got += chunk
        return c

    try:
        # Every one accepted and counted: each answers a request (and stays open). A fixed sleep was
        # not enough on a loaded 2-core machine (the 21st was accepted first once); and the readiness
        # probe's connection, closed by the client, may still count for a moment on a loaded machine
        # (one of the 20 was refused once): a refusal while fewer than 20 are held is retried.
        deadline = time.time() + 15
        while len(socks) < 20:
            c = held()
            if c is not None:
                socks.append(c)
                continue
            assert time.time() < deadline, f"only {len(socks)} connections held under a cap of 20"
            time.sleep(0.1)
        t0 = time.time()
        resp = raw(s.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", read_all=False)
        assert time.time() - t0 < 2
        assert status_of(resp) == 503 and b"too many open connections" in resp
    finally:
        for c in socks:
            c.close()
    try:
        time.sleep(0.3)
        still_serving(s)
    finally:
        s.stop()


def test_connect_burst_is_not_throttled_by_the_backlog(server):
    """A burst of 300 connects completes at once (the listen backlog was 5 under httplib: 3 s for 50)."""
    t0 = time.time()
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(300)]
    elapsed = time.time() - t0
    for c in socks:
        c.close()
    assert elapsed < 1.0, elapsed


def test_sigterm_with_a_trickling_client_exits_within_the_grace(tiny_model, tmp_path):
    s = Server(tiny_model, tmp_path / "serve.log", "--shutdown-grace", "2")
    stop = threading.Event()
    t = threading.Thread(target=trickle, args=(s.port, stop), daemon=True)
    t.start()
    try:
        time.sleep(1.5)
        t0 = time.time()
        s.proc.terminate()
        s.proc.wait(timeout=20)
        assert time.time() - t0 < 4
        assert s.proc.returncode == 0
    finally:
        stop.set()
        s.stop()


def test_sigterm_lets_a_short_request_finish(tiny_model, tmp_path):
    """Within the grace period a request in flight gets its whole answer (1000 tokens: long enough
    to be seen running; the grace is far longer than they take even under ASan on a loaded 2-core
    machine, where 2000 tokens once took most of a 40 s grace)."""
    s = Server(tiny_model, tmp_path / "serve.log", "--shutdown-grace", "180")
    result = {}

    def req():
        result["r"] = s.post(COMP, {"prompt": "finish me", "max_tokens": 1000, "ignore_eos": True})

    th = threading.Thread(target=req)
    th.start()
    deadline = time.time() + 10
    while s.metrics()["kdtree_requests_running"] < 1:
        assert time.time() < deadline
        time.sleep(0.01)
    s.proc.terminate()
    th.join(timeout=200)
    s.proc.wait(timeout=200)
    status, _, r = result["r"]
    assert status == 200 and r["usage"]["completion_tokens"] == 1000, (status, r)
    assert s.proc.returncode == 0


def test_sigterm_while_loading_exits_at_once(tiny_model, tmp_path):
    os.environ["KDTREE_SERVE_LOAD_DELAY_MS"] = "60000"
    try:
        s = Server(tiny_model, tmp_path / "serve.log", wait_ready=False)
    finally:
        del os.environ["KDTREE_SERVE_LOAD_DELAY_MS"]
    assert s.request("GET", "/health")[0] == 503
    t0 = time.time()
    s.proc.terminate()
    s.proc.wait(timeout=20)
    assert time.time() - t0 < 4
    assert s.proc.returncode == 0


def test_fifo_config_fails_fast(tiny_model, tmp_path):
    """A FIFO where config.json should be is refused by name instead of blocking the load forever."""
    import shutil
    model = tmp_path / "tiny-fifo"
    shutil.copytree(tiny_model, model)
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    s = Server(model, tmp_path / "serve.log", wait_ready=False)
    s.proc.wait(timeout=20)
    assert s.proc.returncode == 1
    assert "config.json" in s.log.read_text() and "not a regular file" in s.log.read_text()


# --- bounded load test ----------------------------------------------------------------------------

def proc_stats(pid: int) -> tuple[int, int, int]:
    """(RSS KiB, threads, open descriptors) of the server process."""
    rss = threads = 0
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss, threads, len(os.listdir(f"/proc/{pid}/fd"))


def test_hostile_load_stays_flat(tiny_model, tmp_path):
    """64 clients at once — good (streamed and not), bad (malformed, deep, oversized, compressed),
    slow (trickled headers) and cancelled (streams dropped mid-answer) — for KDTREE_HOSTILE_SECONDS:
    every good request is answered, and RSS, threads and descriptors come back to where they were."""
    seconds = float(os.environ.get("KDTREE_HOSTILE_SECONDS", "45"))
    s = Server(tiny_model, tmp_path / "serve.log", "--parallel", "8", "--max-queue", "256", "--header-timeout", "3",
               "--max-body", "1")
    rng = random.Random(0)
    deep = post_bytes(CHAT, ('{"messages": ' + nest(DEEP) + "}").encode())
    oversized = post_bytes(COMP, b'{"prompt": "' + b"a" * (2 << 20) + b'"}')
    gz = post_bytes(COMP, gzip.compress(b'{"prompt": "a"}'), "Content-Encoding: gzip\r\n")
    failures = []

    def one(i: int) -> None:
        kind = i % 8
        try:
            if kind in (0, 1):
                body = {"prompt": f"good {i}", "max_tokens": 1 + i % 12, "seed": i}
                if kind == 1:
                    body["stream"] = True
                status, _, data = s.request("POST", COMP, body, timeout=120)
                ok = status == 200 and (b"[DONE]" in data if kind == 1 else json.loads(data)["usage"]["completion_tokens"] >= 1)
                if not ok:
                    failures.append((i, status, data[:200]))
            elif kind == 2:
                status, _, _ = s.request("POST", CHAT, {"messages": MSGS, "max_tokens": 3, "seed": i}, timeout=120)
                if status != 200:
                    failures.append((i, status))
            elif kind == 3:
                if status_of(raw(s.port, deep)) != 400:
                    failures.append((i, "deep"))
            elif kind == 4:
                if status_of(raw(s.port, oversized)) != 413:
                    failures.append((i, "oversized"))
            elif kind == 5:
                if status_of(raw(s.port, gz)) != 415:
                    failures.append((i, "gzip"))
            elif kind == 6:  # slow: headers a few bytes at a time, then abandoned or dropped at the deadline
                stop = threading.Event()
                timer = threading.Timer(rng.uniform(0.5, 5), stop.set)
                timer.start()
                trickle(s.port, stop)
                timer.cancel()
            else:  # a stream cancelled after its first event
                c = socket.create_connection(("127.0.0.1", s.port), timeout=30)
                body = b'{"prompt":"bye","max_tokens":200,"ignore_eos":true,"stream":true}'
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(body)).encode()
                          + b"\r\n\r\n" + body)
                c.recv(1024)
                c.close()
        except Exception as e:  # noqa: BLE001 — any client-side failure of a good request is a failure
            if kind in (0, 1, 2):
                failures.append((i, repr(e)))

    def quiet():
        deadline = time.time() + 30
        while time.time() < deadline:
            m = s.metrics()
            if m["kdtree_requests_running"] == 0 and m["kdtree_requests_waiting"] == 0:
                break
            time.sleep(0.1)
        time.sleep(1.5)  # idle keep-alive and lingering connections close (--idle-timeout 1)

    try:
        with ThreadPoolExecutor(max_workers=64) as ex:  # warm-up: allocator pools, every thread started
            list(ex.map(one, range(128)))
        quiet()
        before = proc_stats(s.pid)
        t_end, i, done = time.time() + seconds, 128, 0
        with ThreadPoolExecutor(max_workers=64) as ex:
            while time.time() < t_end:
                list(ex.map(one, range(i, i + 128)))
                i += 128
                done += 128
        quiet()
        after = proc_stats(s.pid)
        print(f"hostile load: {done} clients in {seconds:.0f} s; RSS/threads/fds before {before}, after {after}")
        assert not failures, failures[:10]
        assert done >= 128
        rss0, th0, fd0 = before
        rss1, th1, fd1 = after
        assert th1 == th0, f"threads {th0} → {th1}"
        assert fd1 <= fd0 + 2, f"descriptors {fd0} → {fd1}"
        # Under ASan (KDTREE_SANITIZED=1) freed memory sits in the allocator's quarantine by design:
        # there LeakSanitizer at the exit is the check instead of RSS.
        if not os.environ.get("KDTREE_SANITIZED"):
            assert rss1 - rss0 < max(32 * 1024, rss0 // 4), f"RSS {rss0} → {rss1} KiB"
        assert s.metrics()["kdtree_kv_blocks_used"] == 0
        still_serving(s)
    finally:
        s.stop()
    assert s.proc.returncode == 0, s.log.read_text()[-2000:]


@pytest.mark.parametrize("flags", [["--budget", "100000"], ["--parallel", "99999999999999999999"], ["--port", "-1"],
                                   ["--max-body", "0x10"], ["--max-connections", "0"], ["--timeout", "1e3"]])
def test_serve_refuses_bad_numbers_before_loading(tiny_model, flags):
    """Out-of-range or non-decimal numbers are usage errors (exit 2) at once, never saturated or
    read in another base; a budget beyond kMaxTreeBudget (memory ∝ budget²) is among them."""
    import subprocess
    from conftest import BIN
    t0 = time.time()
    p = subprocess.run([str(BIN), "serve", "-m", str(tiny_model), *flags], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert flags[0] in p.stderr and time.time() - t0 < 5
