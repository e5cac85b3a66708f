#!/usr/bin/env bash
# What `make install` spends installing: pip with its bytecode compilation of every installed module (the default)
# against pip --no-compile followed by one import of what ftkit's processes import (the Makefile's WARM_IMPORTS),
# each in a fresh virtual environment, wall seconds per step. Packages come from pip's cache after the first run.
#
#     bash benchmarks/install_time.sh [TORCH_SPEC]
set -euo pipefail
cd "$(dirname "$0")/.."
torch=${1:-torch==2.13.0}
warm=$(make -s --no-print-directory -f Makefile -f - print-warm-imports <<'EOF'
print-warm-imports:
	@echo '$(WARM_IMPORTS)'
EOF
)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
seconds() { local t0=$(date +%s.%N); "$@" >/dev/null 2>&1; echo "$(date +%s.%N) - $t0" | bc; }
for mode in compile no-compile; do
    venv=$tmp/$mode
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1
    flag=(); [ "$mode" = no-compile ] && flag=(--no-compile)
    t_torch=$(seconds "$venv/bin/python" -m pip install "${flag[@]}" --progress-bar off "$torch")
    t_rest=$(seconds "$venv/bin/python" -m pip install "${flag[@]}" --progress-bar off -e ".[dev]")
    t_warm=$(PYTHONDONTWRITEBYTECODE= DS_ACCELERATOR=cpu seconds "$venv/bin/python" -c "$warm")
    t_again=$(PYTHONDONTWRITEBYTECODE= DS_ACCELERATOR=cpu seconds "$venv/bin/python" -c "$warm")
    printf '%-10s  torch %6.1f s  ftkit[dev] %6.1f s  first import %5.1f s  next import %5.1f s\n' \
        "$mode" "$t_torch" "$t_rest" "$t_warm" "$t_again"
done
