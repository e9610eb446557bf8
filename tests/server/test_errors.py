"""The error table (raw HTTP: what a well-behaved client cannot send), authentication, limits
(context, body size, queue), and the server staying up through all of it. Every error body is
{"error": {"code": status, "message", "type", "param"}}."""
from __future__ import annotations

import json
import os
import threading
import time

import openai
import pytest
from conftest import Server

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def check_error(status, body, want_status, want_type, param=None, words=()):
    assert status == want_status, body
    assert set(body) == {"error"}, body
    e = body["error"]
    assert e["code"] == want_status and e["type"] == want_type and isinstance(e["message"], str) and e["message"]
    if param is not None:
        assert e["param"] == param, e
    for w in words:
        assert w in e["message"], e


BAD_REQUESTS = [
    # (path, body, param, words in the message)
    (CHAT, {"messages": []}, "messages", ["empty"]),
    (CHAT, {}, "messages", ["required"]),
    (CHAT, {"messages": "hi"}, "messages", ["array"]),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages", ["role"]),
    (CHAT, {"messages": MSGS, "n": 2}, "n", ["n = 1"]),
    (CHAT, {"messages": MSGS, "max_tokens": -1}, "max_tokens", ["at least 1"]),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens", []),
    (CHAT, {"messages": MSGS, "max_tokens": "ten"}, "max_tokens", ["integer"]),
    (CHAT, {"messages": MSGS, "temperature": "hot"}, "temperature", ["number"]),
    (CHAT, {"messages": MSGS, "temperature": -1}, "temperature", []),
    (CHAT, {"messages": MSGS, "top_p": 0}, "top_p", []),
    (CHAT, {"messages": MSGS, "top_k": 1.5}, "top_k", ["integer"]),
    (CHAT, {"messages": MSGS, "min_p": 2}, "min_p", []),
    (CHAT, {"messages": MSGS, "seed": -3}, "seed", []),
    # integers beyond int64 were read wrapped: top_k 2**64-1 became -1 and was accepted as "off";
    # seed / max_tokens were refused quoting -1, a value the client never sent
    (CHAT, {"messages": MSGS, "top_k": 2**64 - 1}, "top_k", ["18446744073709551615"]),
    (CHAT, {"messages": MSGS, "seed": 2**64 - 1}, "seed", ["18446744073709551615"]),
    (CHAT, {"messages": MSGS, "max_tokens": 2**63}, "max_tokens", ["9223372036854775808"]),
    (CHAT, {"messages": MSGS, "stream": "yes"}, "stream", ["boolean"]),
    (CHAT, {"messages": MSGS, "stop": 5}, "stop", []),
    (CHAT, {"messages": MSGS, "stop": ["a", 1]}, "stop[1]", []),
    (CHAT, {"messages": MSGS, "stop": [str(i) for i in range(17)]}, "stop", ["at most"]),
    (CHAT, {"messages": MSGS, "stop": [""]}, "stop", ["empty"]),
    (CHAT, {"messages": MSGS, "stream_options": {"include_usage": True}}, "stream_options", []),
    (CHAT, {"messages": MSGS, "logprobs": 3}, "logprobs", ["boolean"]),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, "top_logprobs", ["logprobs"]),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs", []),
    (CHAT, {"messages": MSGS, "tools": {"a": 1}}, "tools", []),
    (CHAT, {"messages": MSGS, "tools": [{"type": "retrieval"}]}, "tools[0]", []),
    (CHAT, {"messages": MSGS, "tool_choice": "required"}, "tool_choice", ["tools"]),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", ["'g'"]),
    (CHAT, {"messages": MSGS, "tool_choice": "sometimes"}, "tool_choice", []),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs", []),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": {"thinking": "on"}}, "thinking", []),
    (CHAT, {"messages": MSGS, "presence_penalty": 0.5}, "presence_penalty", ["not supported"]),
    (CHAT, {"messages": MSGS, "logit_bias": {"1": 5}}, "logit_bias", []),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"x": {"patternProperties": {}}}}}}}, "response_format",
     ["$.properties.x.patternProperties: not supported"]),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema"}}, "response_format", ["schema"]),
    (CHAT, {"messages": MSGS, "response_format": {"type": "regex"}}, "response_format", []),
    (COMP, {"prompt": "x", "grammar": "root ::= foo"}, "grammar", ["'foo' is used but never defined"]),
    (COMP, {"prompt": "x", "grammar": "root ::= root \"a\" | \"b\""}, "grammar", ["left-recursive"]),
    (CHAT, {"messages": MSGS, "functions": []}, "functions", []),
    # nested fields of the wrong type are refused as values, never a 500
    (CHAT, {"messages": MSGS, "tools": [{"type": 3}]}, "tools[0]", []),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": 5, "function": {"name": "f"}}}, "tool_choice", []),
    (CHAT, {"messages": MSGS, "response_format": {"type": 1}}, "response_format", []),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}, "messages", []),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"function": "f"}]}]}, "messages", []),
    (COMP, {"prompt": ""}, "prompt", ["empty"]),
    (COMP, {"prompt": ["a", "b"]}, "prompt", ["one"]),
    (COMP, {"prompt": [1, -2]}, "prompt", []),
    (COMP, {"prompt": [1, 99999]}, "prompt", ["vocabulary"]),
    (COMP, {"prompt": 5}, "prompt", []),
    (COMP, {"prompt": "x", "logprobs": 30}, "logprobs", []),
    (COMP, {"prompt": "x", "echo": True}, "echo", []),
    (COMP, {"prompt": "x", "best_of": 3}, "best_of", []),
    (COMP, {"prompt": "x", "messages": MSGS}, "messages", []),
]


@pytest.mark.parametrize("path,body,param,words", BAD_REQUESTS, ids=[f"{i}" for i in range(len(BAD_REQUESTS))])
def test_bad_request_is_400_naming_the_field(server, path, body, param, words):
    status, _, r = server.post(path, body)
    check_error(status, r, 400, "invalid_request_error", param, words)


@pytest.mark.parametrize("raw,words", [
    (b'{"messages": [', ["not valid JSON"]),
    (b'[1, 2]', ["JSON object"]),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', ["UTF-8"]),
    (b'', ["not valid JSON"]),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e999}', ["not valid JSON"]),  # number overflow
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', ["not valid JSON"]),  # lone surrogate
])
def test_malformed_bodies(server, raw, words):
    status, _, data = server.request("POST", CHAT, raw)
    check_error(status, json.loads(data), 400, "invalid_request_error", None, words)


def test_tokenize_errors(server, enc):
    status, _, r = server.post("/tokenize", {"content": "x", "with_pieces": "yes"})
    check_error(status, r, 400, "invalid_request_error", "with_pieces")
    status, _, r = server.post("/tokenize", {"text": "x"})
    check_error(status, r, 400, "invalid_request_error", "content")
    status, _, r = server.post("/detokenize", {"tokens": [1, -1]})
    check_error(status, r, 400, "invalid_request_error", "tokens")
    status, _, r = server.post("/tokenize", {"content": "x", "with_pieces": True})
    assert status == 200 and r["tokens"] == [{"id": enc.encode("x")[0], "piece": "x"}]


def test_unknown_fields_are_ignored(server):
    status, _, r = server.post(CHAT, {"messages": MSGS, "max_tokens": 2, "user": "u1", "metadata": {"a": "b"}, "store": False,
                                      "frobnicate": 3})
    assert status == 200, r


def test_unknown_model_and_route_are_404(server, client):
    status, _, r = server.post(CHAT, {"model": "gpt-9", "messages": MSGS})
    check_error(status, r, 404, "invalid_request_error", "model", ["gpt-9"])
    status, _, data = server.request("GET", "/v2/nothing")
    check_error(status, json.loads(data), 404, "not_found_error")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=MSGS)


def test_openai_client_sees_400_as_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=3)
    assert e.value.status_code == 400


def test_max_queue_zero_still_serves(tiny_model, tmp_path):
    """--max-queue 0 means "never queue", not "refuse everything": free slots still take requests
    (the bound used to count requests about to be admitted as waiting)."""
    s = Server(tiny_model, tmp_path / "serve.log", "--parallel", "2", "--max-queue", "0")
    try:
        status, _, r = s.post(COMP, {"prompt": "a", "max_tokens": 4})
        assert status == 200, r
    finally:
        s.stop()


def test_limits(tiny_model, tmp_path):
    """Context, body size and queue limits on a deliberately small server; it keeps serving."""
    s = Server(tiny_model, tmp_path / "serve.log", "-c", "64", "--max-body", "1", "--parallel", "1", "--max-queue", "1")
    try:
        long_prompt = "word " * 200
        status, _, r = s.post(COMP, {"prompt": long_prompt, "max_tokens": 4})
        check_error(status, r, 400, "exceed_context_size_error", "prompt", ["64"])
        status, _, r = s.post(CHAT, {"messages": [{"role": "user", "content": long_prompt}]})
        check_error(status, r, 400, "exceed_context_size_error", "messages")
        # 2 MiB body against a 1 MiB limit
        status, _, data = s.request("POST", COMP, json.dumps({"prompt": "x" * (2 << 20)}))
        check_error(status, json.loads(data), 413, "invalid_request_error")
        # One running + one waiting fill the engine; more get 503 with Retry-After.
        results = []

        def long_request():
            results.append(s.post(COMP, {"prompt": "a", "max_tokens": 60, "ignore_eos": True}))

        threads = [threading.Thread(target=long_request) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        busy = [r for r in results if r[0] == 503]
        ok = [r for r in results if r[0] == 200]
        assert busy and ok, [r[0] for r in results]
        for status, hdrs, body in busy:
            check_error(status, body, 503, "unavailable_error")
            assert hdrs["retry-after"] == "1"
        status, _, r = s.post(COMP, {"prompt": "a", "max_tokens": 2})
        assert status == 200
    finally:
        s.stop()


def test_api_key(tiny_model, tmp_path):
    s = Server(tiny_model, tmp_path / "serve.log", "--api-key", "sekret")
    try:
        assert s.request("GET", "/health")[0] == 200  # /health needs no key (load balancers)
        for path in ("/v1/models", "/metrics"):
            status, _, data = s.request("GET", path)
            check_error(status, json.loads(data), 401, "authentication_error")
        status, _, r = s.post(CHAT, {"messages": MSGS}, headers={"Authorization": "Bearer wrong!"})
        check_error(status, r, 401, "authentication_error")
        status, _, r = s.post(CHAT, {"messages": MSGS}, headers={"Authorization": "Bearer sekre"})
        check_error(status, r, 401, "authentication_error")
        status, _, r = s.post(CHAT, {"messages": MSGS}, headers={"Authorization": "sekret"})
        check_error(status, r, 401, "authentication_error")
        with pytest.raises(openai.AuthenticationError):
            s.client("bad").models.list()
        c = s.client("sekret")
        assert c.models.list().data[0].id == "tiny"
        assert c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2).usage.completion_tokens >= 1
    finally:
        s.stop()


def test_load_failure_exits_cleanly(tmp_path):
    """Binds first, then the load fails (no checkpoint): /health was 503 meanwhile, exit status 1."""
    bad = tmp_path / "empty-model"
    bad.mkdir()
    s = Server(bad, tmp_path / "serve.log", wait_ready=False)
    s.proc.wait(timeout=30)
    assert s.proc.returncode == 1
    assert "error:" in s.log.read_text()


def test_bad_flags_exit_2_or_1(tiny_model, tmp_path):
    import subprocess
    from conftest import BIN
    p = subprocess.run([str(BIN), "serve", "-m", str(tiny_model), "--draft", "synthetic:oracle"], capture_output=True, text=True)
    assert p.returncode == 1 and "synthetic" in p.stderr
    p = subprocess.run([str(BIN), "serve", "-m", str(tiny_model), "--port", "70000"], capture_output=True, text=True)
    assert p.returncode == 2
    p = subprocess.run([str(BIN), "serve", "--help"], capture_output=True, text=True)
    assert p.returncode == 0
    for flag in ("--host", "--port", "--api-key", "--parallel", "--ctx-size", "--kv-tokens", "--timeout", "--draft"):
        assert flag in p.stdout


def test_slow_client_times_out(tiny_model, tmp_path):
    """A client that sends half a request and stalls is dropped after --timeout seconds."""
    import socket
    s = Server(tiny_model, tmp_path / "serve.log", "--timeout", "1")
    try:
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        sock.settimeout(10)
        t0 = time.time()
        data = sock.recv(65536)
        while data:
            more = sock.recv(65536)
            if not more:
                break
            data += more
        assert time.time() - t0 < 8  # closed (or answered) by the server, not by our own timeout
        sock.close()
        assert s.request("GET", "/health")[0] == 200
    finally:
        s.stop()


def test_health_503_while_loading(tiny_model, tmp_path):
    """The server binds before it loads: while it loads (held there for 3 s by the testing aid
    KDTREE_SERVE_LOAD_DELAY_MS) every route answers 503 (Retry-After), then it serves."""
    os.environ["KDTREE_SERVE_LOAD_DELAY_MS"] = "3000"
    try:
        s = Server(tiny_model, tmp_path / "serve.log", wait_ready=False)
    finally:
        del os.environ["KDTREE_SERVE_LOAD_DELAY_MS"]
    try:
        status, hdrs, data = s.request("GET", "/health")
        check_error(status, json.loads(data), 503, "unavailable_error", None, ["loading"])
        status, hdrs, r = s.post(CHAT, {"messages": MSGS})
        check_error(status, r, 503, "unavailable_error")
        assert hdrs["retry-after"] == "1"
        assert s.metrics()["kdtree_model_loading"] == 1
        s.wait_ready()
        assert s.metrics()["kdtree_model_loading"] == 0
        assert s.post(CHAT, {"messages": MSGS, "max_tokens": 2})[0] == 200
    finally:
        s.stop()


def test_idle_connection_is_closed(server):
    """A connection that never sends a request is closed after --idle-timeout (1 s in these tests)."""
    import socket
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(10)
    t0 = time.time()
    assert sock.recv(1024) == b""  # orderly close by the server
    assert time.time() - t0 < 5
    sock.close()


def test_sigterm_mid_stream_exits_promptly(tiny_model, tmp_path):
    """SIGTERM with a long stream in flight: the stream is cancelled (it gets an error event, no
    [DONE]) and the server exits 0 within seconds, not after the generation."""
    import socket
    s = Server(tiny_model, tmp_path / "serve.log", "--shutdown-grace", "1")
    body = b'{"prompt":"long","max_tokens":100000,"ignore_eos":true,"stream":true}'
    sock = socket.create_connection(("127.0.0.1", s.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    data = b""
    while data.count(b"data: ") < 3:
        data += sock.recv(4096)
    t0 = time.time()
    s.proc.terminate()
    sock.settimeout(20)
    while True:
        more = sock.recv(65536)
        if not more:
            break
        data += more
    s.proc.wait(timeout=20)
    assert time.time() - t0 < 10
    assert s.proc.returncode == 0, s.log.read_text()[-2000:]
    assert b"server shutting down" in data and b"[DONE]" not in data
