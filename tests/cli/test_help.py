"""`--help` of `kdtree` and of every subcommand documents every flag the contract names (DESIGN.md §5);
`--version` prints the version."""
import re

import pytest

from conftest import kdtree

SUBCOMMANDS = {
    None: ["--help", "--version", "--threads", "--verbose", "--quiet", "run", "inspect", "make-model", "bench",
           "serve"],
    "run": ["-m", "--model", "-p", "--prompt", "--prompt-ids", "-n", "--n-predict", "-c", "--ctx-size", "--temp",
            "--top-k", "--top-p", "--min-p", "-s", "--seed", "--ignore-eos", "--json", "--dump-logits", "--spec",
            "--draft", "--budget", "--budget-max", "--device", "--decode-attn"],
    "inspect": ["-m", "--model", "--preset", "--config", "--ctx", "--json"],
    "make-model": ["--preset", "--config", "-o", "--out", "-s", "--seed", "--shards", "--force", "tiny", "small",
                   "medium", "k2"],
    "serve": ["-m", "--model", "-a", "--alias", "--draft", "--spec", "--budget", "--budget-max", "--host", "--port", "--api-key",
              "--parallel", "-c", "--ctx-size", "--kv-tokens", "--kv-block", "--prefill-chunk", "--max-queue",
              "--no-prefix-cache", "--timeout", "--idle-timeout", "--max-body", "--threads-http", "--device"],
    "bench": ["-m", "--model", "-p", "--n-prompt", "-n", "--n-gen", "-r", "--repetitions", "--device", "--json"],
    "plan-budget": ["--verify-ms", "--profile", "--block-size", "--draft-ms", "--budget-max", "--vocab", "--json"],
}


def _flag_present(flag: str, text: str) -> bool:
    # A whole word: "-m" must not be satisfied by "--min-p", nor "--top-p" by "--top-pp".
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


@pytest.mark.parametrize("sub", list(SUBCOMMANDS), ids=[s or "kdtree" for s in SUBCOMMANDS])
def test_help_lists_every_flag(sub):
    args = ([sub] if sub else []) + ["--help"]
    r = kdtree(*args, ok=True)
    assert r.stdout.strip(), "help goes to stdout"
    missing = [f for f in SUBCOMMANDS[sub] if not _flag_present(f, r.stdout)]
    assert not missing, f"`kdtree {' '.join(args)}` does not mention {missing}\n{r.stdout}"
    assert "Usage" in r.stdout or "usage" in r.stdout


@pytest.mark.parametrize("sub", [s for s in SUBCOMMANDS if s])
def test_short_help_flag(sub):
    long = kdtree(sub, "--help", ok=True)
    short = kdtree(sub, "-h", ok=True)
    assert short.stdout == long.stdout


def test_help_does_not_need_a_model():
    # --help wins over required options: no -m, still exit 0.
    r = kdtree("run", "--help", ok=True)
    assert "--prompt-ids" in r.stdout


def test_version():
    r = kdtree("--version", ok=True)
    assert re.search(r"\bkdtree\b.*\b\d+\.\d+\.\d+\b", r.stdout), r.stdout
    top = kdtree("--help", ok=True)
    version = re.search(r"\d+\.\d+\.\d+", r.stdout).group(0)
    assert version in top.stdout, "--help and --version disagree on the version"
