"""--draft-yarn-legacy-mscale through the CLI: by default a YaRN DFlash drafter takes the reference
rule's cos/sin amplitude (transformers' mscale ratio: 1.0 for tests/fixtures/dflash-yarn), the flag
forces the legacy 0.1·ln(factor) + 1 (≈ 1.4159 at factor 64); either way the output is AR's. The
flag is listed in run's and serve's --help and refused where it would do nothing."""
import json
import math

import pytest

from conftest import FIXTURES, kdtree

TARGET = FIXTURES / "k2-bf16"
YARN = FIXTURES / "dflash-yarn"
BASE = ["run", "-m", str(TARGET), "--prompt-ids", "5,6,7,8", "-n", "12", "--ignore-eos", "--json"]


def test_default_is_the_reference_rule_and_the_flag_forces_the_legacy_factor():
    ar = kdtree(*BASE, "-q")
    assert ar.returncode == 0, ar.stderr
    plain = kdtree(*BASE, "--spec", "ddtree", "--draft", str(YARN))
    legacy = kdtree(*BASE, "--spec", "ddtree", "--draft", str(YARN), "--draft-yarn-legacy-mscale")
    for r in (plain, legacy):
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["output_ids"] == json.loads(ar.stdout)["output_ids"]
    assert "cos/sin amplitude 1 (mscale_ratio)" in plain.stderr
    want = 1 + 0.1 * math.log(64)
    line = next(l for l in legacy.stderr.splitlines() if "cos/sin amplitude" in l)
    assert "(legacy_option)" in line
    assert float(line.split("cos/sin amplitude ")[1].split()[0]) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("args,expect", [
    (["--spec", "ddtree", "--draft", str(FIXTURES / "dflash-rope")], "has no YaRN rope_scaling"),
    (["--spec", "ddtree", "--draft", "synthetic:oracle"], "only applies to a DFlash drafter"),
    ([], "only applies to a DFlash drafter"),
])
def test_legacy_flag_where_it_does_nothing_is_an_error(args, expect):
    r = kdtree("run", "-m", str(TARGET), "--prompt-ids", "1,2", "-n", "2", *args, "--draft-yarn-legacy-mscale")
    assert 0 < r.returncode < 128
    assert expect in r.stderr, r.stderr


@pytest.mark.parametrize("cmd", ["run", "serve"])
def test_legacy_flag_is_documented_in_help(cmd):
    r = kdtree(cmd, "--help")
    assert r.returncode == 0
    assert "--draft-yarn-legacy-mscale" in r.stdout and "0.1·ln(factor) + 1" in r.stdout
