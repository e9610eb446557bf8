#!/usr/bin/env python3
"""--budget auto on the CPU (docs/perf.md): `table` runs AR, fixed budgets and --budget auto with a
random DFlash drafter and synthetic drafters, interleaved, REPS rounds, and prints the markdown table
(median and range of decode tokens/s; outputs checked equal to AR's); `ab` runs AR / --budget auto pairs
back to back. Usage: bench/budget-auto-cpu.py table|ab KDTREE MODEL DRAFTER_DIR [REPS] [N_TOKENS]
(make MODEL with `kdtree make-model --preset tiny --seed 0`, DRAFTER_DIR with `--drafter-for MODEL --seed 0`)."""
import json, subprocess, statistics, sys
K, M, D = sys.argv[2], sys.argv[3], sys.argv[4]
base = [K, "run", "-m", M, "--prompt-ids", "1,17,42,99,7,300,5,12", "-n", sys.argv[6] if len(sys.argv) > 6 else "256", "--ignore-eos", "--json", "-q"]
configs = [
    ("ar", "–", "–", []),
    ("ddtree", "random DFlash", "auto", ["--spec", "ddtree", "--draft", D]),
    ("ddtree", "random DFlash", "4", ["--spec", "ddtree", "--draft", D, "--budget", "4"]),
    ("ddtree", "random DFlash", "16", ["--spec", "ddtree", "--draft", D, "--budget", "16"]),
    ("dflash", "random DFlash", "auto", ["--spec", "dflash", "--draft", D, "--budget", "auto"]),
    ("ddtree", "synthetic:oracle", "auto", ["--spec", "ddtree", "--draft", "synthetic:oracle"]),
    ("ddtree", "synthetic:oracle", "1", ["--spec", "ddtree", "--draft", "synthetic:oracle", "--budget", "1"]),
    ("ddtree", "synthetic:oracle", "4", ["--spec", "ddtree", "--draft", "synthetic:oracle", "--budget", "4"]),
    ("ddtree", "synthetic:oracle", "16", ["--spec", "ddtree", "--draft", "synthetic:oracle", "--budget", "16"]),
    ("dflash", "synthetic:oracle", "–", ["--spec", "dflash", "--draft", "synthetic:oracle"]),
    ("ddtree", "synthetic:0.9,0.05", "auto", ["--spec", "ddtree", "--draft", "synthetic:0.9,0.05"]),
    ("ddtree", "synthetic:0.9,0.05", "4", ["--spec", "ddtree", "--draft", "synthetic:0.9,0.05", "--budget", "4"]),
    ("ar T=0.8", "–", "–", ["--temp", "0.8", "--seed", "1"]),
    ("ddtree T=0.8", "random DFlash", "auto", ["--spec", "ddtree", "--draft", D, "--temp", "0.8", "--seed", "1"]),
]
reps = int(sys.argv[5]) if len(sys.argv) > 5 else 5

def ab():
    pairs = [("greedy", [], ["--spec", "ddtree", "--draft", D]),
             ("dflash auto", [], ["--spec", "dflash", "--draft", D, "--budget", "auto"]),
             ("T=0.8", ["--temp", "0.8", "--seed", "1"], ["--spec", "ddtree", "--draft", D, "--temp", "0.8", "--seed", "1"])]
    def tps(args):
        return json.loads(subprocess.run(base + args, capture_output=True, text=True, check=True).stdout)["timings"]["decode_tokens_per_s"]
    print("| pair | AR t/s | auto t/s | ratio of medians | median of ratios |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, a, b in pairs:
        ra, rb = [], []
        for r in range(reps):
            ra.append(tps(a)); rb.append(tps(b))
        ratios = [y / x for x, y in zip(ra, rb)]
        print("| %s | %.0f | %.0f | %.3f | %.3f |" % (name, statistics.median(ra), statistics.median(rb),
              statistics.median(rb) / statistics.median(ra), statistics.median(ratios)), flush=True)


if sys.argv[1] == "ab":
    ab()
    sys.exit(0)
res = {i: [] for i in range(len(configs))}
outs = {}
for r in range(reps):
    for i, (mode, d, b, extra) in enumerate(configs):
        j = json.loads(subprocess.run(base + extra, capture_output=True, text=True, check=True).stdout)
        res[i].append(j)
        key = "T0.8" if "--temp" in extra else "T0"
        outs.setdefault(key, j["output_ids"])
        assert j["output_ids"] == outs[key], (mode, d, b)
    print("rep", r, file=sys.stderr, flush=True)
print("| decoder | drafter | budget | tokens/s (median of %d) | min–max | τ | chosen N (rounds), last run | AR steps | predicted / measured t/s |" % reps)
print("| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
for i, (mode, d, b, extra) in enumerate(configs):
    tps = [j["timings"]["decode_tokens_per_s"] for j in res[i]]
    s = res[i][-1]["spec"]
    auto = "budget_histogram" in s
    hist = " ".join("N%s:%d" % kv for kv in s["budget_histogram"].items()) if auto else "–"
    ar_steps = "%d / %d" % (s["ar_steps"], s["rounds"]) if auto else "–"
    pm = "%.0f / %.0f" % (statistics.median([j["spec"]["predicted_tokens_per_s"] for j in res[i]]),
                          statistics.median([j["spec"]["measured_tokens_per_s"] for j in res[i]])) if auto else "–"
    print("| %s | %s | %s | %.0f | %.0f–%.0f | %.2f | %s | %s | %s |" % (mode, d, b, statistics.median(tps), min(tps), max(tps),
          s["mean_accepted_length"], hist, ar_steps, pm))
