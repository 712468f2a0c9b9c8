#!/usr/bin/env bash
# Stages everything the GPU runs need into .gpu/ (git-ignored; carried to the offline GPU
# machine, < 64 MiB): TE 2.20.2 and its dependencies plus upstream megatron-core 0.19.2
# (../shared/gpu-wheels), this repository's build for 0.19.2, 0.16.1 and 0.18.2 with those two
# upstream wheels, the example plugin, and the Megatron-LM snapshots with our series
# (upstream/make_gpu_bundle.py) plus the one test dependency the machine lacks (mock).
# Usage: bash scripts/device/make-bundle.sh [MEGATRON_LM_GIT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
mlm_git=${1:-/work/.mirror/NVIDIA+Megatron-LM/repo}
rm -rf .gpu && mkdir -p .gpu/upstream
cp -r ../shared/gpu-wheels .gpu/wheels && chmod -R u+w .gpu
for version in 0.19.2 0.16.1 0.18.2; do
  wheel=$(ls build/upstream/megatron_core-"$version"-cp312-*.whl 2>/dev/null | head -n 1 || true)
  [[ -n "$wheel" ]] || python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d build/upstream "megatron-core==$version"
  wheel=$(ls build/upstream/megatron_core-"$version"-cp312-*.whl | head -n 1)
  MCORE_UPSTREAM_WHEEL=$wheel python -m pip wheel -q --no-deps -w ".gpu/dist-$version" .
  [[ $version == 0.19.2 ]] || cp "$wheel" .gpu/upstream/
done
python -m pip wheel -q --no-deps -w .gpu/plugin ./examples/te-precision-aware-adopter
python upstream/make_gpu_bundle.py --git-dir "$mlm_git" --out .gpu/mlm
python -m pip download -q --no-deps --only-binary=:all: -d .gpu/mlm-wheels mock==5.2.0
du -sh .gpu
