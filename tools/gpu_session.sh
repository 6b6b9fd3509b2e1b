#!/usr/bin/env bash
# One GPU session on the device machine: unpack TileLang, build the kernels, then run the parts
# asked for. Everything it reports goes to $OUT (the device tool brings that folder back).
#   bash tools/gpu_session.sh [PARTS] [extra bench args...]
# PARTS is a comma list of
#   tests      the GPU tests (tests/test_kernels_*.py and the slot path)
#   tune       the kernel variants of benchmarks/tune_kernels.py, timed against each other
#   bench      benchmarks/bench_kernels.py, with the extra arguments
#   bench_gpu  the same in GPU time (DSA_REF_BENCH_QUEUE_AHEAD=1), to bench_kernels_gpu_time.json
#   verify     `dsa-ref verify --gpu --json` (every identity, plus the kernels)
#   notebooks  every notebook (its jupytext .py) run as a script on the GPU (their GPU branches)
#   refmem     the reference layer's memory at 32K tokens
#   cp         context parallelism on NCCL (one rank), TileLang and reference
#   layers     the DSAttention step benchmark at 4096 and 8192 tokens
#   peers      benchmarks/bench_peers.py: dsa_ref's kernels beside FlashMLA, Megatron's TileLang ops and
#              TileLang's deepseek_v32 examples, loaded from .gpu/peers (FlashMLA is built from
#              .gpu/peers/flashmla in the benchmark's compile phase), with the extra arguments, to
#              $OUT/bench_peers.json (+ .log, .png, known_kernels.md)
#   profile    benchmarks/profile_layer_step.py: the layer step under torch.profiler at 4K/8K/16K
#              tokens, both stages, to $OUT/profile_layer_step.{json,md}; with .gpu/before (see ab)
#              also that tree's at 4K, to $OUT/profile_before/
#   ab         benchmarks/bench_layer_ab.py: the layer step of this tree against the one in .gpu/before
#              (`git archive <commit> dsa_ref | tar -x -C .gpu/before`), alternating, 4K/8K/16K tokens,
#              both stages, with the host synchronisations of one step counted
#   kl         benchmarks/bench_slot_kl.py: the fused KL kernel, split into kernel, Function and wrapper
#   longref    the readable reference's long-context points (bench_long_context.py --points, sparse 4K /
#              64K / 128K and dense warm-up 64K; LONGREF_TIMEOUT seconds per point, default 400)
#   fp8        the indexers alone: the bf16 and fp8 indexer GPU tests, then benchmarks/bench_indexer_fp8.py
#              (fp8 vs the bf16 default and its fastest schedules, every fp8 schedule, accuracy against
#              the simulation, top-k overlap)
# or one of the shorthands check = tests,tune, final = tests,refmem,cp,layers and
# all = tests,tune,bench (the default).
# Environment: TEST_TIMEOUT, TUNE_TIMEOUT (seconds); TUNE_KERNELS (default indexer,topk) and
# TUNE_BACKWARD=0 narrow the tuning; DSA_REF_BENCH_QUEUE_AHEAD=1 makes bench_kernels.py measure GPU
# time instead of one call on an idle GPU. PEERS_BUDGET (seconds, default 480) bounds bench_peers.
# PRECOMPILE_ONLY (e.g. indexer,indexer_fp8,topk for `fp8`) compiles only those kernels up front.
# At the end every report under $OUT except gpu.txt and the kernel cache is packed into
# $OUT/reports.tar.gz (the device tool brings back only so many files); PACK=0 leaves them loose.
set -uo pipefail
what=${1:-all}; shift || true
case "$what" in
  all) what=tests,tune,bench ;; check) what=tests,tune ;; final) what=tests,refmem,cp,layers ;;
esac
has() { [[ ",$what," == *",$1,"* ]]; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/tilelang-0.1.15-cp312-site.tar.xz
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export DSA_REF_TILELANG_ARCH=sm_90a TILELANG_LOG_LEVEL=WARNING
if [ -f .gpu/tl_cache.tar.xz ]; then mkdir -p ~/.tilelang && tar -C ~/.tilelang -xJf .gpu/tl_cache.tar.xz; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, tilelang; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'tilelang', tilelang.__version__)" | tee -a "$OUT/gpu.txt"
python3 benchmarks/precompile_kernels.py --jobs 16 --tune ${PRECOMPILE_ONLY:+--only "$PRECOMPILE_ONLY"} 2>&1 \
  | tee "$OUT/precompile.log"
if has tests; then
  timeout "${TEST_TIMEOUT:-400}" python3 -m pytest --durations=15 tests/test_kernels_*.py tests/test_slot_path.py \
    -q -p no:cacheprovider -rs --maxfail=20 2>&1 | tee "$OUT/gpu_tests.log"
fi
if has tune; then
  # the sparse MLA backward in its own process: a variant that faults cannot take the others along;
  # TUNE_KERNELS narrows the first process (e.g. TUNE_KERNELS=indexer TUNE_BACKWARD=0)
  timeout "${TUNE_TIMEOUT:-150}" python3 benchmarks/tune_kernels.py --kernels "${TUNE_KERNELS:-indexer,topk}" \
    --out "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log"
  if [ "${TUNE_BACKWARD:-1}" = 1 ]; then
    timeout "${TUNE_TIMEOUT:-150}" python3 benchmarks/tune_kernels.py --kernels backward --out "$OUT/tune_bwd.json" \
      2>&1 | tee -a "$OUT/tune.log"
  fi
fi
if has fp8; then
  timeout "${TEST_TIMEOUT:-400}" python3 -m pytest tests/test_kernels_indexer_fp8.py tests/test_kernels_indexer.py \
    -q -p no:cacheprovider -rs \
    --durations=10 2>&1 | tee "$OUT/gpu_tests_fp8.log"
  timeout 400 python3 benchmarks/bench_indexer_fp8.py --out "$OUT/bench_indexer_fp8.json" 2>&1 \
    | tee "$OUT/bench_indexer_fp8.log"
fi
if has bench; then
  python3 benchmarks/bench_kernels.py --out "$OUT/bench_kernels.json" "$@" 2>&1 | tee "$OUT/bench.log"
fi
if has bench_gpu; then
  DSA_REF_BENCH_QUEUE_AHEAD=1 python3 benchmarks/bench_kernels.py --out "$OUT/bench_kernels_gpu_time.json" "$@" 2>&1 \
    | tee "$OUT/bench_gpu_time.log"
fi
if has verify; then
  timeout 200 python3 -m dsa_ref verify --gpu --json > "$OUT/verify_gpu.json" 2> "$OUT/verify_gpu.err"; echo "verify rc $?"
fi
if has notebooks; then
  python3 tools/run_notebooks_as_scripts.py notebooks/*.py --timeout 150 2>&1 | tee "$OUT/notebooks.log"
fi
if has refmem; then
  timeout 300 python3 benchmarks/bench_reference_memory.py --device cuda --seqlens 32768 --kinds layer \
    --modes layer --warmup 1 --repeats 2 --no-self-check --timeout 280 --out "$OUT/refmem_32k" 2>&1 | tail -30
fi
if has cp; then
  timeout 150 python3 -m torch.distributed.run --nproc-per-node 1 benchmarks/bench_cp.py --tokens 16384 \
    --backends tilelang,reference --reps 2 --out "$OUT/bench_cp_n1.json" 2>&1 | grep -v Warning | tail -8
fi
if has layers; then
  timeout 150 python3 benchmarks/bench_kernels.py --quick --shapes 4096x8192 --layer-tokens 4096,8192 \
    --out "$OUT/bench_layers.json" 2>&1 | tail -12
fi
if has peers; then
  # its compile phase builds FlashMLA (MAX_JOBS=16 nvcc jobs, /tmp/flashmla_build) beside the TileLang compiles
  if [ ! -d .gpu/peers ]; then echo "no .gpu/peers: every peer will be recorded as skipped"; fi
  MAX_JOBS=16 FLASHMLA_BUILD_DIR=/tmp/flashmla_build timeout $(( ${PEERS_BUDGET:-480} + 60 )) \
    python3 benchmarks/bench_peers.py --peers .gpu/peers --budget-s "${PEERS_BUDGET:-480}" \
    --out "$OUT/bench_peers.json" "$@" 2>&1 | tee "$OUT/bench_peers.log"
  if [ -f "$OUT/bench_peers.json" ]; then
    python3 tools/plots/bench_peers_plot.py --json "$OUT/bench_peers.json" --out "$OUT/bench_peers.png" || true
    python3 tools/known_kernels_page.py "$OUT/bench_peers.json" --figure "$OUT/bench_peers.png" \
      > "$OUT/known_kernels.md" || true
  fi
fi
if has ab; then
  timeout 900 python3 benchmarks/bench_layer_ab.py --other .gpu/before --count-syncs --timeout-s 400 \
    --out "$OUT/bench_layer_ab.json" 2>&1 | tee "$OUT/bench_layer_ab.log"
fi
if has kl; then
  timeout 200 python3 benchmarks/bench_slot_kl.py --out "$OUT/bench_slot_kl.json" 2>&1 | tee "$OUT/bench_slot_kl.log"
fi
if has longref; then
  timeout $(( 4 * ${LONGREF_TIMEOUT:-400} + 60 )) python3 benchmarks/bench_long_context.py \
    --points reference:sparse:4096,reference:dense_warmup:65536,reference:sparse:65536,reference:sparse:131072 \
    --point-timeout-s "${LONGREF_TIMEOUT:-400}" --point-limit-s "${LONGREF_TIMEOUT:-400}" \
    --budget-s $(( 4 * ${LONGREF_TIMEOUT:-400} )) --out "$OUT/longref" 2>&1 | tee "$OUT/long_context_reference.log"
fi
if has profile; then
  timeout 300 python3 benchmarks/profile_layer_step.py --out "$OUT" 2>&1 | grep -v "USDT\|profiler_st" | tee "$OUT/profile.log"
  if [ -d .gpu/before/dsa_ref ]; then  # the same tables for the other tree of `ab`, at 4096 tokens
    DSA_REF_CODE=.gpu/before timeout 200 python3 benchmarks/profile_layer_step.py --tokens 4096 --out "$OUT/profile_before" \
      2>&1 | grep -v "USDT\|profiler_st" | tee "$OUT/profile_before.log"
  fi
fi
tar -C ~/.tilelang -cJf "$OUT/tl_cache.tar.xz" cache 2>/dev/null || true
if [ "${PACK:-1}" = 1 ]; then
  (cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name gpu.txt ! -name tl_cache.tar.xz ! -name reports.tar.gz \
     -printf '%P\n' > /tmp/reports.list && tar -czf reports.tar.gz -T /tmp/reports.list && xargs -a /tmp/reports.list rm -rf)
fi
