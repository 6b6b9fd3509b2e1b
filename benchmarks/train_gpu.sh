#!/usr/bin/env bash
# Chapter 6 on one GPU: the four runs of `dsa-ref train` (dense, dsa, dsa_no_warmup, dense_continued)
# with the TileLang kernels at a long context, then the step time of dense against sparse there.
#
#   OUT=/tmp/out bash benchmarks/train_gpu.sh            # on the H200 (about 5 minutes, 1 seed)
#   DEVICE=cpu BACKEND=reference MODEL=tiny CONTEXT=256 TOPK=32 STEPS_DENSE=6 SHORT_STEPS=4 \
#     STEPS_WARMUP=2 STEPS_SPARSE=2 OUT=/tmp/o bash benchmarks/train_gpu.sh   # a CPU smoke test
#
# Files written to $OUT (8): train.log, config.json, summary.json, log.jsonl, curves.png,
# step_time.json, step_time.log, env.txt. Checkpoints stay in $RUN_DIR (outside $OUT).
#
# The GPU model is chosen for the kernels (`dsa_ref/kernels/shapes.py` and the `*_supported`
# checks): bfloat16 attention, 16 MLA heads over a 512 + 64 = 576-wide latent (d_v = 512),
# a 16-head indexer of dim 128. With --backend tilelang a shape the kernels decline is an error.
set -euo pipefail
OUT=${OUT:-build/train_gpu}; mkdir -p "$OUT"
RUN_DIR=${RUN_DIR:-/tmp/dsa_train_gpu_run}
DEVICE=${DEVICE:-cuda}; BACKEND=${BACKEND:-tilelang}; MODEL=${MODEL:-gpu}
CONTEXT=${CONTEXT:-8192}; TOPK=${TOPK:-512}; SEEDS=${SEEDS:-1}; BATCH=${BATCH:-4}
NUM_PAIRS=${NUM_PAIRS:-16}; VOCAB=${VOCAB:-48}; LR=${LR:-0.001}
SHORT_CONTEXT=${SHORT_CONTEXT:-128}; SHORT_STEPS=${SHORT_STEPS:-150}; STEPS_DENSE=${STEPS_DENSE:-300}
STEPS_WARMUP=${STEPS_WARMUP:-40}; STEPS_SPARSE=${STEPS_SPARSE:-80}
EVAL_EVERY=${EVAL_EVERY:-25}; EVAL_BATCH=${EVAL_BATCH:-16}

if [ "$BACKEND" != reference ] && [ -f .gpu/tilelang-0.1.15-cp312-site.tar.xz ]; then
  # the TileLang setup of tools/gpu_session.sh
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/tilelang-0.1.15-cp312-site.tar.xz
  export PYTHONPATH=/tmp/site:$PWD
  export DSA_REF_TILELANG_ARCH=sm_90a TILELANG_LOG_LEVEL=WARNING
  if [ -f .gpu/tl_cache.tar.xz ]; then mkdir -p ~/.tilelang && tar -C ~/.tilelang -xJf .gpu/tl_cache.tar.xz; fi
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1

if [ "$MODEL" = gpu ]; then
  model=(--dim 512 --n-heads 16 --q-lora-rank 256 --kv-lora-rank 512 --qk-nope-head-dim 64
         --qk-rope-head-dim 64 --v-head-dim 128 --index-n-heads 16 --index-head-dim 128 --mlp-hidden 1024)
else  # tiny: the CPU smoke test (the kernels would decline it)
  model=(--dim 32 --n-heads 2 --q-lora-rank 16 --kv-lora-rank 16 --qk-nope-head-dim 8
         --qk-rope-head-dim 4 --v-head-dim 8 --index-n-heads 2 --index-head-dim 8 --mlp-hidden 48)
fi

{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi";
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)";
  python3 -c "import tilelang; print('tilelang', tilelang.__version__)" 2>/dev/null || echo "no tilelang"; } > "$OUT/env.txt"

rm -rf "$RUN_DIR"
start=$(date +%s)
python3 -m dsa_ref train --task mqar --context "$CONTEXT" --topk "$TOPK" --seeds "$SEEDS" --device "$DEVICE" \
  --backend "$BACKEND" --out "$RUN_DIR" --no-progress --num-pairs "$NUM_PAIRS" --vocab-size "$VOCAB" --lr "$LR" \
  --batch-size "$BATCH" --short-context "$SHORT_CONTEXT" --short-context-steps "$SHORT_STEPS" \
  --steps-dense "$STEPS_DENSE" --steps-warmup "$STEPS_WARMUP" --steps-sparse "$STEPS_SPARSE" \
  --eval-every "$EVAL_EVERY" --eval-batch-size "$EVAL_BATCH" --checkpoint-every 1000 "${model[@]}" \
  2>&1 | tee "$OUT/train.log"
echo "train wall seconds: $(( $(date +%s) - start ))" | tee -a "$OUT/train.log"
cp "$RUN_DIR/config.json" "$RUN_DIR/summary.json" "$RUN_DIR/log.jsonl" "$OUT/"
cp "$RUN_DIR/curves.png" "$OUT/" 2>/dev/null || echo "no curves.png (matplotlib missing?)" | tee -a "$OUT/train.log"

python3 benchmarks/bench_train_step.py --config "$RUN_DIR/config.json" --json "$OUT/step_time.json" \
  --warmup "${BENCH_WARMUP:-2}" --repeat "${BENCH_REPEAT:-5}" 2>&1 | tee "$OUT/step_time.log"
echo "total wall seconds: $(( $(date +%s) - start ))" | tee -a "$OUT/step_time.log"
