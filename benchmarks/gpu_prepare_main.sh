#!/usr/bin/env bash
# Gathers what a run on Nanotron main (7bc9923) needs on the GPU machine into the ignored .gpu/, from the
# development machine, in the project's root:
#   bash benchmarks/gpu_prepare_main.sh NANOTRON_GIT_DIR
# ../shared/gpu/prepare.sh, then what main needs beyond 2cde8f6:
# - the versions main imports work with: transformers 4.52.4 (with its tokenizers and huggingface_hub; the
#   GPU image's are too new for it), datasets 3.6.0, dill 0.3.8, multiprocess 0.70.16, torchtyping with
#   typeguard 2;
# - py-spy, which `gpu.sh gil-180m` runs;
# - a grouped_gemm stand-in whose ops raise (only mixture of experts calls them);
# - Llama's random init: main's `models/llama.py` hands its parametrizator the model's arguments where it
#   reads the whole config (`config.model.init_method`), so a run of main's Llama from random weights raises
#   AttributeError, stock or ours; the harness's copy gets the one-line fix `parametrizator_cls(config=config)`.
# The cmake and ninja wheels are dropped: the GPU image has both, and .gpu/ must stay under the device
# tool's carry limit with the tree.
set -euo pipefail
src=${1:?usage: gpu_prepare_main.sh NANOTRON_GIT_DIR}
dest=.gpu
NANOTRON_COMMIT=7bc9923285a03069ebffe994379a311aceaea546 \
  EXTRA_WHEELS="torchtyping typeguard==2.13.3 transformers==4.52.4 tokenizers==0.21.1 huggingface_hub==0.33.1" \
  bash ../shared/gpu/prepare.sh "$src" "$dest"
rm -f "$dest"/wheels/{datasets,dill,multiprocess,cmake,ninja}-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest/wheels" datasets==3.6.0 dill==0.3.8 multiprocess==0.70.16
# py-spy, for `gpu.sh gil-180m` (a static binary in a wheel for any Python)
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 -d "$dest/wheels" \
  py-spy==0.4.3
mkdir -p "$dest/site/grouped_gemm"
cat >"$dest/site/grouped_gemm/__init__.py" <<'PY'
"""A stand-in for grouped_gemm (CUDA-only): Nanotron main imports it; only mixture of experts calls it."""
from . import ops  # noqa: F401
PY
cat >"$dest/site/grouped_gemm/ops.py" <<'PY'
def gmm(*args, **kwargs):
    raise NotImplementedError("grouped_gemm stand-in: mixture of experts is not supported on this machine")
PY
llama="$dest/nanotron/src/nanotron/models/llama.py"
grep -q "parametrizator_cls(config=config.model)" "$llama"
sed -i "s/parametrizator_cls(config=config.model)/parametrizator_cls(config=config)/" "$llama"
du -sh "$dest"
