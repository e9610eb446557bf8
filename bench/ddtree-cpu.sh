#!/usr/bin/env bash
# DDTree on the CPU: tokens/s of AR, the DFlash chain and DDTree at several budgets, under the
# synthetic oracle drafter and under a stated synthetic profile (rank-0 0.9, rank-1 0.05: a chain
# τ ≈ 5.3 at block 8, Kimi-K2.5-DFlash's published acceptance), plus the verify cost curve.
# Synthetic drafters know the target's continuation (they run AR first, untimed); their τ is a
# stated assumption, not a measured acceptance. `auto` rows are --budget auto (the chosen budgets,
# AR-fallback steps and the model's predicted vs measured tokens/s of its rounds).
# Usage: [DRAFTER=DIR] bench/ddtree-cpu.sh [MODEL_DIR] [N_TOKENS]
set -euo pipefail
cd "$(dirname "$0")/.."
kdtree=build/release/kdtree
model="${1:-build/models/medium}"
n="${2:-64}"
[ -x "$kdtree" ] || scripts/build release >/dev/null
[ -f "$model/config.json" ] || $kdtree make-model --preset medium -o "$model"
prompt=1,17,42,99,7,300,5,12
echo "model $model, $n tokens, greedy, commit $(git rev-parse --short HEAD), $(nproc) threads"
echo
echo "| decoder | drafter | budget | rounds | τ | tokens/s | verify ms/round | chosen N (rounds) | AR steps | predicted / measured t/s |"
echo "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"
row() {  # decoder drafter budget
  local args=(-m "$model" --prompt-ids $prompt -n "$n" --ignore-eos --json -q)
  [ "$1" != ar ] && args+=(--spec "$1" --draft "$2")
  [ "$1" != ar ] && [ "$3" != - ] && args+=(--budget "$3")
  $kdtree run "${args[@]}" | python3 -c '
import json, sys
j = json.load(sys.stdin); s = j["spec"]; t = j["timings"]
vr = s.get("verify_ms", 0) / max(1, s["rounds"])
auto = "budget_histogram" in s
hist = " ".join("N%s:%d" % kv for kv in s["budget_histogram"].items()) if auto else "–"
ar_steps = str(s["ar_steps"]) if auto else "–"
pm = "%.0f / %.0f" % (s["predicted_tokens_per_s"], s["measured_tokens_per_s"]) if auto else "–"
print("| %s | %s | %s | %d | %.2f | %.1f | %.1f | %s | %s | %s |" % (s["mode"], sys.argv[1], sys.argv[2], s["rounds"],
      s["mean_accepted_length"], t["decode_tokens_per_s"], vr, hist, ar_steps, pm))
' "$2" "$3"
}
row ar - -
for d in synthetic:oracle synthetic:0.9,0.05 "${DRAFTER:-}"; do
  [ -n "$d" ] || continue  # DRAFTER=DIR adds a (e.g. random) DFlash drafter's rows
  row dflash "$d" -
  row dflash "$d" auto
  for b in 4 16 64 auto; do row ddtree "$d" "$b"; done
done
echo
$kdtree bench -m "$model" -p 64 -n 16 -r 3 --verify-curve
