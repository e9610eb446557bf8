"""Shared fixtures for the `kdtree serve` tests (tests/server).

The server runs the embedded tiny model, made the way scripts/demo makes it
(`kdtree make-model --preset tiny --tokenizer tests/fixtures/tokenizer-kimi-small`), on a free port.
Clients: the official `openai` Python client (python/requirements-test.txt pins it) and raw HTTP
(http.client) for what a well-behaved client cannot send. Independent references: tiktoken built from
the fixture tokenizer exactly as tokenization_kimi.py builds Kimi's, and jinja2 rendering the
committed chat template (tests/fixtures/chat-templates/kimi-k2.jinja) the way transformers does.

The binary comes from $KDTREE_BIN (default <repo>/build/release/kdtree). On a GPU machine
scripts/gpu-check runs some of these tests with KDTREE_SERVE_WRAP (a command the server runs under,
e.g. "compute-sanitizer --tool memcheck"), KDTREE_SERVE_ARGS (extra flags, e.g. "--device cuda") and
KDTREE_SERVE_DRAFTER=1 (serve the tiny model with a DFlash drafter made for it: DDTree serving).
"""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
TOK = FIXTURES / "tokenizer-kimi-small"
BIN = Path(os.environ.get("KDTREE_BIN") or REPO / "build" / "release" / "kdtree").absolute()


def pytest_configure(config):
    if not BIN.is_file():
        pytest.exit(f"kdtree binary not found at {BIN}: build it (scripts/build release) or set KDTREE_BIN", returncode=4)


class Server:
    """A `kdtree serve` process on a free port; its stderr goes to a log file."""

    def __init__(self, model: Path, log: Path, *args: str, wait_ready: bool = True, idle_timeout: int = 1):
        self.log = log
        # --idle-timeout 1: stopping waits for idle keep-alive connections (the client pools them).
        wrap = os.environ.get("KDTREE_SERVE_WRAP", "").split()
        extra = os.environ.get("KDTREE_SERVE_ARGS", "").split()
        drafter = model.parent / (model.name + "-dflash")
        if os.environ.get("KDTREE_SERVE_DRAFTER") and drafter.is_dir() and "--draft" not in args:
            extra += ["--draft", str(drafter)]  # DDTree serving (the tiny_model fixture made the drafter)
        self.args = [*wrap, str(BIN), "serve", "-m", str(model), "--port", "0", "-t", "1", "--idle-timeout", str(idle_timeout),
                     *extra, *map(str, args)]
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=open(log, "w"), cwd=REPO)
        self.port = self._wait_port()
        self.base = f"http://127.0.0.1:{self.port}"
        if wait_ready:
            self.wait_ready()

    @property
    def pid(self) -> int:
        """The kdtree process itself (under KDTREE_SERVE_WRAP, the wrapper's kdtree descendant)."""
        if not os.environ.get("KDTREE_SERVE_WRAP"):
            return self.proc.pid
        todo = [self.proc.pid]
        while todo:
            p = todo.pop()
            try:
                if Path(f"/proc/{p}/comm").read_text().strip() == "kdtree":
                    return p
                for t in Path(f"/proc/{p}/task").iterdir():
                    todo += [int(c) for c in (t / "children").read_text().split()]
            except OSError:
                pass
        return self.proc.pid

    def _wait_port(self) -> int:
        deadline = time.time() + 30
        while time.time() < deadline:
            m = re.search(r"listening on http://[^:]+:(\d+)", self.log.read_text(errors="replace"))
            if m:
                return int(m.group(1))
            if self.proc.poll() is not None:
                raise RuntimeError(f"kdtree serve exited {self.proc.returncode}:\n{self.log.read_text()}")
            time.sleep(0.02)
        raise RuntimeError(f"kdtree serve did not bind:\n{self.log.read_text()}")

    def wait_ready(self, timeout: float = 60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.request("GET", "/health")[0] == 200:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"kdtree serve exited {self.proc.returncode}:\n{self.log.read_text()}")
            time.sleep(0.05)
        raise RuntimeError("kdtree serve never became ready")

    def request(self, method: str, path: str, body=None, headers=None, timeout: float = 120):
        """Raw HTTP: returns (status, headers dict, body bytes). body: dict → JSON, bytes/str as is."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        try:
            conn.request(method, path, body=body, headers=hdrs)
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def post(self, path: str, body, headers=None):
        status, hdrs, data = self.request("POST", path, body, headers)
        return status, hdrs, json.loads(data) if data else None

    def metrics(self) -> dict[str, float]:
        status, _, data = self.request("GET", "/metrics")
        assert status == 200
        out = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def client(self, api_key: str = "none"):
        import openai
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def stop(self):
        if self.proc.poll() is None:
            # Under a wrapper (compute-sanitizer) the signal goes to kdtree itself: the wrapper would die of
            # it without reporting; it exits with kdtree's status (or its own error code) once kdtree has.
            target = self.pid
            if target != self.proc.pid:
                os.kill(target, signal.SIGTERM)
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("models") / "tiny"
    subprocess.run([str(BIN), "make-model", "--preset", "tiny", "--seed", "0", "-o", str(d), "--force",
                    "--tokenizer", str(TOK)], check=True, capture_output=True)
    if os.environ.get("KDTREE_SERVE_DRAFTER"):
        subprocess.run([str(BIN), "make-model", "--drafter-for", str(d), "-o", str(d.parent / "tiny-dflash"), "--force"],
                       check=True, capture_output=True)
    return d


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    s = Server(tiny_model, tmp_path_factory.mktemp("logs") / "serve.log", "--parallel", "8")
    yield s
    s.stop()
    assert s.proc.returncode == 0, f"serve exited {s.proc.returncode} on SIGTERM:\n{s.log.read_text()[-3000:]}"


@pytest.fixture(scope="session")
def client(server):
    return server.client()


@pytest.fixture(scope="session")
def enc():
    """tiktoken built as tokenization_kimi.py builds Kimi's, over the fixture's ranks."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    sys.path.insert(0, str(REPO / "python"))
    from make_tokenizer import PAT_STR
    ranks = load_tiktoken_bpe(str(TOK / "tiktoken.model"))
    n = len(ranks)
    named = json.loads((TOK / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    specials = {named.get(str(i), {}).get("content", f"<|reserved_token_{i}|>"): i for i in range(n, n + 256)}
    return tiktoken.Encoding("kimi-small", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def deep_sort(x):
    if isinstance(x, dict):
        return {k: deep_sort(v) for k, v in sorted(x.items())}
    if isinstance(x, list):
        return [deep_sort(v) for v in x]
    return x


def jinja_kimi(messages, tools=None, thinking=None) -> str:
    """The committed Kimi template rendered by jinja2 as transformers' apply_chat_template does
    (Kimi's tokenizer deep-sorts the tools first)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    template = env.from_string((FIXTURES / "chat-templates" / "kimi-k2.jinja").read_text(encoding="utf-8"))
    msgs = []
    for m in messages:
        m = dict(m)
        m.setdefault("content", None)
        msgs.append(m)
    kwargs = dict(messages=msgs, add_generation_prompt=True)
    if tools:
        kwargs["tools"] = deep_sort(tools)
    if thinking is not None:
        kwargs["thinking"] = thinking
    return template.render(**kwargs)


def kdtree_run(*args, timeout: float = 120) -> dict:
    p = subprocess.run([str(BIN), "run", "-t", "1", "--json", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, cwd=REPO)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)
