#!/bin/bash
# Peak RSS and wall time of validate / place / compare on the README's 10,000-request trace, for an
# older checkout (a git worktree) and this one, alternating, in one run (docs/benchmarks.md).
#
#   moetrace synth --model deepseek-v3 --datasets gsm8k,math,mbpp,humaneval,lmsys-chat,xsum,tldr \
#                  --requests 10000 --seed 0 -o /tmp/synth10k
#   git worktree add --detach /tmp/wt-old 4af4afd
#   benchmarks/bench_memory.sh /tmp/synth10k /tmp/wt-old
set -euo pipefail
T=${1:?trace}; OLD=${2:?older checkout}; NEW=$(cd "$(dirname "$0")/.." && pwd); OUT=$(mktemp -d)
run() {  # label checkout args...
  local label=$1 dir=$2; shift 2
  ( cd "$dir" && PYTHONPATH="$dir" /usr/bin/time -v "$NEW/.venv/bin/python" -m moetrace "$@" -q > "$OUT/out" 2> "$OUT/err" )
  echo "$label | $(awk '/Maximum resident/ {printf "%d MiB", $6/1024}' "$OUT/err") | $(awk '/Elapsed/ {print $8}' "$OUT/err")"
}
run "old validate" "$OLD" validate "$T"
run "new validate" "$NEW" validate "$T"
run "old place improved" "$OLD" place "$T" --config DP8TP8EP64 --strategy improved -o "$OUT/po.json" --overwrite
run "new place improved" "$NEW" place "$T" --config DP8TP8EP64 --strategy improved -o "$OUT/pn.json" --overwrite
run "new place joint" "$NEW" place "$T" --config DP8TP8EP64 --strategy joint -o "$OUT/pj.json" --overwrite
run "old compare linear,eplb,data,improved" "$OLD" compare "$T" --config DP8TP8EP64 --strategies linear,eplb,data,improved -o "$OUT/co" --overwrite
run "new compare linear,eplb,data,improved --no-oracle" "$NEW" compare "$T" --config DP8TP8EP64 --strategies linear,eplb,data,improved --no-oracle -o "$OUT/cn" --overwrite
run "new compare (defaults)" "$NEW" compare "$T" --config DP8TP8EP64 -o "$OUT/cd" --overwrite
rm -rf "$OUT"
