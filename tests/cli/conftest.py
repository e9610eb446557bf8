"""Shared helpers for the `kdtree` CLI tests.

The binary comes from $KDTREE_BIN (default <repo>/build/release/kdtree); fixtures from
<repo>/tests/fixtures (made by python/make_fixtures.py from HF transformers, see its README).
Goldens are read with `safetensors.numpy`, a reader independent of the engine's own. Tensors numpy
cannot hold (BF16) are read through `RawSafetensors`, which parses the format by hand so that tests
can also write headers byte for byte (8-byte little-endian length, JSON, data); well-formed rewrites
(a tensor dropped or swapped) go through the library's own `serialize_file`.

The suite also runs against the sanitizer build, where a memory or UB error must fail the test:
  ASAN_OPTIONS=abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:abort_on_error=1 \
  KDTREE_BIN=build/asan/kdtree build/venv-test/bin/pytest -q tests/cli
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from safetensors import TensorSpec, serialize_file
from safetensors.numpy import load_file

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
BIN = Path(os.environ.get("KDTREE_BIN") or REPO / "build" / "release" / "kdtree").absolute()

MODEL_FIXTURES = ["k2-bf16", "dsv3-group", "k2-int4", "k25-sharded"]
N_GOLDEN = 48  # greedy_ids holds 48 tokens for every fixture

DTYPE_SIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
              "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}

# safetensors header dtype → the Python library's dtype name.
LIB_DTYPE = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
             "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
             "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def pytest_configure(config):
    if not BIN.is_file():
        pytest.exit(f"kdtree binary not found at {BIN}: build it (scripts/build release) or set KDTREE_BIN", returncode=4)


# ---------------------------------------------------------------------------------------------
# Running the binary

@dataclass
class Result:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        """The whole of stdout as exactly one JSON object (json.loads rejects anything around it)."""
        obj = json.loads(self.stdout)
        assert isinstance(obj, dict), f"stdout is JSON but not an object: {self.stdout[:200]!r}"
        return obj

    def __str__(self) -> str:
        return (f"kdtree {' '.join(self.args)}\n-> rc={self.returncode}\n--- stdout ---\n{self.stdout[-2000:]}"
                f"\n--- stderr ---\n{self.stderr[-2000:]}")


def kdtree(*args, timeout: float = 60, ok: bool | None = None) -> Result:
    """Runs the binary. ok=True asserts exit 0, ok=False asserts a clean error exit (1..127, no signal)."""
    argv = [str(a) for a in args]
    p = subprocess.run([str(BIN), *argv], capture_output=True, text=True, timeout=timeout,
                       errors="replace", cwd=REPO)
    r = Result(argv, p.returncode, p.stdout, p.stderr)
    if ok is True:
        assert r.returncode == 0, str(r)
    elif ok is False:
        assert_clean_failure(r)
    return r


def assert_clean_failure(r: Result, code: int | None = None) -> None:
    """Exit ≠ 0 through a normal exit (a signal shows as a negative returncode, a shell-reported one
    as ≥ 128), with an error message on stderr."""
    assert r.returncode != 0, f"expected failure\n{r}"
    assert 0 < r.returncode < 128, f"crashed (signal) instead of a clean error\n{r}"
    if code is not None:
        assert r.returncode == code, f"expected exit {code}\n{r}"
    assert r.stderr.strip(), f"no message on stderr\n{r}"


def ids_arg(ids) -> str:
    return ",".join(str(int(i)) for i in ids)


def run_json(model, prompt_ids, *extra, n: int = N_GOLDEN) -> dict:
    r = kdtree("run", "-m", model, "--prompt-ids", ids_arg(prompt_ids), "-n", n, "--json", *extra, ok=True)
    return r.json()


# ---------------------------------------------------------------------------------------------
# Fixtures and goldens

_golden_cache: dict[str, dict[str, np.ndarray]] = {}


def golden(name: str) -> dict[str, np.ndarray]:
    if name not in _golden_cache:
        _golden_cache[name] = load_file(str(FIXTURES / name / "golden.safetensors"))
    return _golden_cache[name]


def golden_prompt(name: str) -> list[int]:
    return [int(x) for x in golden(name)["prompt_ids"]]


def golden_greedy(name: str) -> list[int]:
    return [int(x) for x in golden(name)["greedy_ids"]]


def vocab_size(model_dir: Path) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["vocab_size"])


def copy_fixture(name: str, dest: Path) -> Path:
    """A writable copy of a model fixture (the goldens stay behind: they are not part of a checkpoint)."""
    out = Path(dest) / name
    shutil.copytree(FIXTURES / name, out, ignore=shutil.ignore_patterns("golden.*"))
    return out


def edit_json(path: Path, fn) -> None:
    """Loads a JSON file, lets fn mutate it in place (its return value is ignored), writes it back."""
    data = json.loads(Path(path).read_text())
    fn(data)
    Path(path).write_text(json.dumps(data, indent=2))


# ---------------------------------------------------------------------------------------------
# Hand-rolled safetensors access: the tests control every byte of a header this way.

def write_raw_safetensors(path: Path, header: bytes | str | dict, data: bytes = b"",
                          length: int | None = None) -> None:
    """Writes 8-byte LE length + header + data exactly; `length` overrides the stated header length."""
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    if isinstance(header, str):
        header = header.encode()
    n = len(header) if length is None else length
    Path(path).write_bytes(struct.pack("<Q", n) + header + data)


class RawSafetensors:
    """One safetensors file as (ordered header dict, data section bytes)."""

    def __init__(self, path: Path):
        raw = Path(path).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        self.header_len = n
        self.header: dict = json.loads(raw[8:8 + n])
        self.data = raw[8 + n:]

    @property
    def names(self) -> list[str]:
        return [k for k in self.header if k != "__metadata__"]

    def bytes_of(self, name: str) -> bytes:
        b, e = self.header[name]["data_offsets"]
        return self.data[b:e]

    def array(self, name: str) -> np.ndarray:
        """BF16 widened to float32 exactly; other dtypes as numpy holds them."""
        info = self.header[name]
        raw = self.bytes_of(name)
        dt = info["dtype"]
        if dt == "BF16":
            a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            a = np.frombuffer(raw, dtype={"F32": "<f4", "F16": "<f2", "I32": "<i4", "I64": "<i8",
                                          "I8": "i1", "U8": "u1"}[dt])
        return a.reshape(info["shape"])

    def write(self, path: Path) -> None:
        """Writes the header as it stands (offsets untouched) followed by the data section."""
        write_raw_safetensors(path, self.header, self.data)

    def rewritten(self, path: Path, drop=(), replace: dict | None = None) -> None:
        """A well-formed copy written by the safetensors library, with `drop` removed and
        `replace` = {name: (dtype, shape, bytes)} swapped in."""
        replace = replace or {}
        tensors = {}
        for name in self.names:
            if name in drop:
                continue
            tensors[name] = replace.get(name) or (self.header[name]["dtype"], self.header[name]["shape"],
                                                  self.bytes_of(name))
        save_tensors(path, tensors, metadata=self.header.get("__metadata__"))


def save_tensors(path: Path, tensors: dict, metadata: dict | None = None) -> None:
    """Writes {name: (safetensors dtype, shape, raw little-endian bytes)} with the safetensors library's
    own `serialize_file` (numpy has no bfloat16, so the bytes go in as they are)."""
    keep_alive, specs = [], {}
    for name, (dt, shape, raw) in tensors.items():
        buf = np.frombuffer(raw, dtype=np.uint8).copy() if raw else np.zeros(1, np.uint8)
        keep_alive.append(buf)  # serialize_file reads through the raw pointers below
        specs[name] = TensorSpec(dtype=LIB_DTYPE[dt], shape=list(shape), data_ptr=buf.ctypes.data, data_len=len(raw))
    serialize_file(specs, str(path), metadata=metadata)


def unpack_int4(packed: np.ndarray, k: int) -> np.ndarray:
    """compressed-tensors pack-quantized: word j of a row holds columns 8j..8j+7, column 8j+i in bits
    4i..4i+3 (LSB first), stored as u = q + 8. Returns q as int8 [N, K]."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = np.arange(8, dtype=np.uint32) * 4
    nib = (words[:, :, None] >> shifts[None, None, :]) & 0xF
    return (nib.reshape(words.shape[0], -1)[:, :k].astype(np.int16) - 8).astype(np.int8)
