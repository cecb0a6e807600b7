#!/usr/bin/env bash
# make test: every part of the suite, each run even when one before it failed, then a summary of which ran and passed.
# Exit status: 0 only when every part passed. Each part is a make target (see the Makefile).
set -uo pipefail
cd "$(dirname "$0")/.."
MAKE=${MAKE:-make}
parts=(test-types "types and lint (mypy, ruff)" test-docs "docs site (mkdocs --strict)" test-inprocess "in-process tests (xdist)" test-multiprocess "multi-process tests (2 at once)"
       test-deepspeed "DeepSpeed, transformers, peft" test-floor "floor (oldest Accelerate)" test-wheel "the wheel, installed apart")
names=() results=() seconds=()
failed=0
for ((i = 0; i < ${#parts[@]}; i += 2)); do
    target=${parts[i]} label=${parts[i + 1]}
    echo "=== make $target: $label"
    start=$(date +%s)
    if $MAKE --no-print-directory "$target"; then status=passed; else status=FAILED; failed=$((failed + 1)); fi
    names+=("$label") results+=("$status") seconds+=($(( $(date +%s) - start )))
done
echo
echo "make test: the parts"
for i in "${!names[@]}"; do
    printf '  %-32s %-7s %4d s\n' "${names[i]}" "${results[i]}" "${seconds[i]}"
done
total=${#names[@]}
echo "parts: $((total - failed)) passed, $failed failed"
exit $((failed > 0))
