"""The progress bar on stderr (core/log.h Progress), through `make-model` — the same bar GPU weight loads
draw: plain lines when stderr is not a terminal (each tenth of the work), a bar redrawn with \\r on a
terminal; bytes as MB (GB past a gigabyte) with the rate so far and the time left. KDTREE_PROGRESS_MIN_S=0
shows the bar of a job quicker than the default half second."""
import os
import pty
import re
import select
import subprocess

from conftest import BIN, REPO

LINE = re.compile(r"writing (\S+) \[([#.]{30})\]\s+(\d+\.\d)% (\d+\.\d) / (\d+\.\d) MB, (\d+) MB/s(, ETA \d+s)?, (\d+\.\d)s")


def make_model(out, env_extra, tty=False):
    env = dict(os.environ, **env_extra)
    argv = [str(BIN), "make-model", "--preset", "tiny", "-o", str(out), "--seed", "3"]
    if not tty:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
        assert p.returncode == 0, p.stderr
        return p.stderr
    master, slave = pty.openpty()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=slave, env=env, cwd=REPO)
    os.close(slave)
    chunks = []
    while True:
        r, _, _ = select.select([master], [], [], 120)
        if not r:
            break
        try:
            b = os.read(master, 65536)
        except OSError:
            break
        if not b:
            break
        chunks.append(b)
    assert p.wait(timeout=120) == 0
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_plain_lines_without_a_terminal(tmp_path):
    err = make_model(tmp_path / "m", {"KDTREE_PROGRESS_MIN_S": "0"})
    lines = [m for m in map(LINE.search, err.splitlines()) if m]
    assert len(lines) >= 2, err
    pcts = [float(m.group(3)) for m in lines]
    assert pcts == sorted(pcts) and pcts[-1] == 100.0, err
    assert len(lines) <= 11 + 2, err  # a line a tenth (plus the 10 s heartbeat, none on a job this quick)
    last = lines[-1]
    assert last.group(2) == "#" * 30 and last.group(4) == last.group(5), err
    assert last.group(7) is None, err  # the final line has no ETA …
    assert any(m.group(7) for m in lines[:-1] if float(m.group(4)) > 0), err  # … the running ones do
    assert "\r" not in err
    total = float(last.group(5))
    written = sum(f.stat().st_size for f in (tmp_path / "m").glob("*.safetensors")) / 1e6
    assert abs(total - written) < 0.2, (total, written)


def test_quick_jobs_are_silent_by_default(tmp_path):
    err = make_model(tmp_path / "m", {"KDTREE_PROGRESS_MIN_S": "1000"})
    assert not LINE.search(err), err


def test_a_bar_redrawn_on_a_terminal(tmp_path):
    out = make_model(tmp_path / "m", {"KDTREE_PROGRESS_MIN_S": "0"}, tty=True)
    assert "\r" in out and LINE.search(out), out
    assert re.search(r"100\.0% (\d+\.\d) / \1 MB", out), out
