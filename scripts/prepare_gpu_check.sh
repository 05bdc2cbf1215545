#!/usr/bin/env bash
# Fill the git-ignored folder .gpu/ with what scripts/gpu_check.sh needs on the GPU machine and cannot
# fetch there (it has no network): run it HERE, on a machine with a package index, before the device call.
#
#   .gpu/wheels/   lark (cortexc's parser), and PyCUDA's run-time needs missing on the GPU image:
#                  pytools, platformdirs, mako, siphash24 (pytools needs it); CPython 3.12 manylinux x86_64
#   .gpu/sdist/    PyCUDA's source distribution, built there against its nvcc (no wheel exists)
#   .gpu/sst/      a copy of the SST dev trees (the repository itself must never contain SST)
#   .gpu/pyinc/    CPython 3.12 headers (Python.h, ...), used there only if its python3 has none
#                  (a venv of a system Python without python3.12-dev): PyCUDA's build needs them
#   .gpu/SHA256SUMS checked by gpu_check.sh before it installs anything
#
# Already on the GPU image (KINDS.md), so not carried: numpy, setuptools, wheel (PyCUDA's build),
# jinja2, networkx (cortexc), markupsafe (mako), typing-extensions (pytools), pytest, torch.
# Versions are pinned: one version of each, as `pip install --no-deps` of a folder wants.
#
# Usage (from anywhere): bash scripts/prepare_gpu_check.sh
#   CORTEXC_SST_DIR=...  take SST from elsewhere than ../shared/data/sst
#   PY312=...            a CPython 3.12 interpreter whose headers to carry (default: python3.12 on PATH or pyenv's)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DEST=.gpu
SST_DIR=${CORTEXC_SST_DIR:-../shared/data/sst}
WHEELS=(lark==1.3.1 pytools==2026.1.1 platformdirs==4.14.8 mako==1.4.3 siphash24==1.9)
PYCUDA=pycuda==2026.1

# git-ignore .gpu/ (append once; `git rev-parse --git-path` also finds the file in a worktree)
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"

rm -rf "$DEST/wheels" "$DEST/sdist" "$DEST/sst" "$DEST/pyinc" "$DEST/SHA256SUMS"
mkdir -p "$DEST/wheels" "$DEST/sdist" "$DEST/sst"

echo "== wheels for CPython 3.12 manylinux x86_64: ${WHEELS[*]}"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$DEST/wheels" "${WHEELS[@]}"

echo "== PyCUDA source distribution: $PYCUDA"
# --no-binary for pycuda alone: with :all: pip would also want its build requirements as sdists
"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary=pycuda -d "$DEST/sdist" "$PYCUDA"

echo "== SST dev trees from $SST_DIR"
if [ ! -f "$SST_DIR/dev.txt" ]; then
    echo "error: $SST_DIR/dev.txt not found (set CORTEXC_SST_DIR)" >&2
    exit 1
fi
cp "$SST_DIR/dev.txt" "$DEST/sst/dev.txt"

echo "== CPython 3.12 headers (a fallback for PyCUDA's build)"
# the first candidate that runs as CPython 3.12 (a pyenv shim on PATH may not)
candidates=("${PY312:-}" python3.12)
if command -v pyenv >/dev/null; then
    for version in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12\.[0-9]+$' | sort -t. -k3 -n -r); do
        candidates+=("$(pyenv root)/versions/$version/bin/python3")
    done
fi
py312="" include=""
for candidate in "${candidates[@]}"; do
    [ -n "$candidate" ] || continue
    if include=$("$candidate" -c 'import sys, sysconfig; assert sys.version_info[:2] == (3, 12)
print(sysconfig.get_paths()["include"])' 2>/dev/null); then
        py312=$candidate
        break
    fi
    include=""
done
if [ -n "$include" ] && [ -f "$include/Python.h" ] && [ -f "$include/pyconfig.h" ]; then
    mkdir -p "$DEST/pyinc"
    cp -r "$include" "$DEST/pyinc/python3.12"
    echo "   from $include ($("$py312" -c 'import platform; print(platform.python_version())'))"
else
    echo "   warning: no CPython 3.12 with headers found here (set PY312): not carried" >&2
fi

# one version of each wheel, and the requirements of each one named (extras aside) carried or on the image
count=$(ls "$DEST/wheels"/*.whl | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
    echo "error: expected ${#WHEELS[@]} wheels, got $count" >&2
    exit 1
fi
for whl in "$DEST/wheels"/*.whl; do
    needs=$(unzip -p "$whl" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' |
            sed 's/^Requires-Dist: //' | tr '\n' ';' || true)
    echo "   $(basename "$whl")  needs: ${needs:-nothing}"
done
needs=$(tar -xzOf "$DEST"/sdist/pycuda-*.tar.gz --wildcards '*/PKG-INFO' | grep '^Requires-Dist' |
        sed 's/^Requires-Dist: //' | sort -u | tr '\n' ';')
echo "   $(basename "$DEST"/sdist/pycuda-*.tar.gz)  needs: $needs (build: setuptools, wheel, numpy)"

(cd "$DEST" && find wheels sdist sst pyinc -type f 2>/dev/null | sort | xargs sha256sum >SHA256SUMS)
echo "== $DEST:"
(cd "$DEST" && find . -path ./pyinc -prune -o -type f -print | sort | xargs ls -l |
    awk '{printf "   %9d  %s\n", $5, $9}')
[ -d "$DEST/pyinc" ] && echo "   $(du -sb "$DEST/pyinc" | cut -f1)  ./pyinc/ ($(find "$DEST/pyinc" -type f | wc -l) headers)"
du -sh "$DEST"
bytes=$(du -sb "$DEST" | cut -f1)
if [ "$bytes" -gt $((20 * 1024 * 1024)) ]; then
    echo "error: $DEST is over 20 MiB" >&2
    exit 1
fi
