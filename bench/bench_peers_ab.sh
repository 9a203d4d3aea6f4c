#!/bin/bash
# bench_peers.py from two trees of this repository, shape by shape, the order alternating (issue 52's before/after):
#   BEFORE=DIR AFTER=DIR LLAMA_CPP=DIR bench/bench_peers_ab.sh > ab.log
# Each DIR a worktree (git worktree add DIR COMMIT); the venv is this checkout's.
PY="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python"
i=0
for shape in q46m-v4k q45m-v32k llama-deep llama-gqa8 q2-wide-mlp q3-v152k q36m-l20; do
  if [ $((i % 2)) -eq 0 ]; then order="before after"; else order="after before"; fi
  for side in $order; do
    if [ "$side" = before ]; then dir=$BEFORE; else dir=$AFTER; fi
    echo "=== $shape $side $(date -u +%H:%M:%S)"
    (cd "$dir" && PYTHONPATH="$dir" timeout 900 "$PY" bench/bench_peers.py --llama-cpp "$LLAMA_CPP" --shapes "$shape" \
      --tokens 128 2>&1 | grep -E '^\{|torch threads|Error' | grep -v compiled)
  done
  i=$((i+1))
done
