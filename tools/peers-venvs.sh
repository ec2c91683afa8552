#!/usr/bin/env bash
# The peers' bench-only virtual environments for bench/peers.py: .bench-venvs/<name> for each of kserve,
# mlserver and ray, from its pinned requirement file bench/peers/<name>.txt. None of them is a dependency of
# exitplan. Usage: tools/peers-venvs.sh [name ...]   (default: all three; PYTHON=python3.11)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), "the pins in bench/peers/*.txt are for CPython 3.11: set PYTHON"'
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(kserve mlserver ray)
for name in "${names[@]}"; do
    case "$name" in
        kserve) module=kserve ;;
        mlserver) module=mlserver ;;
        ray) module=ray.serve ;;
        *) echo "unknown peer $name (known: kserve mlserver ray)" >&2; exit 2 ;;
    esac
    req=bench/peers/$name.txt
    venv=.bench-venvs/$name
    if [ -f "$venv/.installed" ] && [ "$venv/.installed" -nt "$req" ]; then
        echo "$venv: up to date with $req"
        continue
    fi
    echo "$venv: installing $req ..."
    rm -rf "$venv"
    "$PYTHON" -P -m venv "$venv"
    # (this machine's pip configuration names local indexes that may not exist: drop pip's warnings about them)
    "$venv/bin/python" -P -m pip install -q -r "$req" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    "$venv/bin/python" -P -c "import $module, onnxruntime, numpy, tokenizers" \
        || { echo "$venv: the install did not give $module, onnxruntime, numpy and tokenizers" >&2; exit 1; }
    touch "$venv/.installed"
    echo "$venv: ready"
done
