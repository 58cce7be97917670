#!/usr/bin/env bash
# Rebuild what device calls carry (`carry: [".baselines", ".wheels"]`) but git does not hold: the device machine has
# no network. Run here (PyPI reachable) when a fresh checkout lacks them (session 11 started without both).
#   .wheels/     fla-core + flash-linear-attention (issue 4's baseline kernels), pytest-xdist + execnet
#   .baselines/  the mamba_ssm package directory from its sdist (issue 3's baseline: only its Triton
#                selective_state_update is used; no compiled extension is needed)
# Usage: bash benchmarks/fetch_device_wheels.sh [root]   (default: the repository root)
set -euo pipefail
ROOT=${1:-$(cd "$(dirname "$0")/.." && pwd)}
FLA=${FLA_VERSION:-0.6.0}
MAMBA=${MAMBA_SSM_VERSION:-2.3.2.post1}
mkdir -p "$ROOT/.wheels" "$ROOT/.baselines"
python3 -m pip download -q --no-deps -d "$ROOT/.wheels" "fla-core==$FLA" "flash-linear-attention==$FLA" \
  "pytest-xdist==3.8.0" "execnet==2.1.2"
tmp=$(mktemp -d)
url=$(curl -sf "https://pypi.org/pypi/mamba-ssm/json" | MAMBA=$MAMBA python3 -c "import json, os, sys
files = json.load(sys.stdin)['releases'][os.environ['MAMBA']]
print([f['url'] for f in files if f['packagetype'] == 'sdist'][0])")
curl -sfL -o "$tmp/mamba.tar.gz" "$url"
tar xzf "$tmp/mamba.tar.gz" -C "$tmp"
rm -rf "$ROOT/.baselines/mamba_ssm"
mv "$tmp"/mamba_ssm-*/mamba_ssm "$ROOT/.baselines/mamba_ssm"
rm -rf "$tmp"
ls "$ROOT/.wheels"; echo "$ROOT/.baselines/mamba_ssm: $(find "$ROOT/.baselines/mamba_ssm" -name '*.py' | wc -l) files"
