#!/usr/bin/env bash
# One GPU session on the device machine: unpack TileLang, build the kernels, run the GPU tests,
# then the benchmarks. Everything it reports goes to $OUT (the device tool brings that folder back).
#   bash tools/gpu_session.sh [tests|bench|all|final] [extra bench args...]
# "notebooks": every notebook's code run as a script on the GPU (their GPU branches).
# "final": the tests, the reference memory benchmark at 32K tokens, CP on NCCL (one rank) and the
# DSAttention step benchmark.
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/tilelang-0.1.15-cp312-site.tar.xz
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export DSA_REF_TILELANG_ARCH=sm_90a TILELANG_LOG_LEVEL=WARNING
if [ -f .gpu/tl_cache.tar.xz ]; then mkdir -p ~/.tilelang && tar -C ~/.tilelang -xJf .gpu/tl_cache.tar.xz; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, tilelang; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'tilelang', tilelang.__version__)" | tee -a "$OUT/gpu.txt"
python3 benchmarks/precompile_kernels.py --jobs 16 2>&1 | tee "$OUT/precompile.log"
if [ "$what" = tests ] || [ "$what" = all ] || [ "$what" = final ]; then
  python3 -m pytest tests/test_kernels_sparse_mla.py tests/test_kernels_indexer.py tests/test_kernels_dsa.py \
    -q -p no:cacheprovider -rs --maxfail=20 2>&1 | tee "$OUT/gpu_tests.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 benchmarks/bench_kernels.py --out "$OUT/bench_kernels.json" "$@" 2>&1 | tee "$OUT/bench.log"
fi
if [ "$what" = notebooks ]; then
  python3 tools/run_notebooks_as_scripts.py notebooks/*.ipynb --timeout 150 2>&1 | tee "$OUT/notebooks.log"
fi
if [ "$what" = final ]; then
  timeout 300 python3 benchmarks/bench_reference_memory.py --device cuda --seqlens 32768 --kinds layer \
    --modes layer --warmup 1 --repeats 2 --no-self-check --timeout 280 --out "$OUT/refmem_32k" 2>&1 | tail -30
  timeout 150 python3 -m torch.distributed.run --nproc-per-node 1 benchmarks/bench_cp.py --tokens 16384 \
    --backends tilelang,reference --reps 2 --out "$OUT/bench_cp_n1.json" 2>&1 | grep -v Warning | tail -8
  timeout 150 python3 benchmarks/bench_kernels.py --quick --shapes 4096x8192 --layer-tokens 4096,8192 \
    --out "$OUT/bench_layers.json" 2>&1 | tail -12
fi
tar -C ~/.tilelang -cJf "$OUT/tl_cache.tar.xz" cache 2>/dev/null || true
