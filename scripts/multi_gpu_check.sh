#!/usr/bin/env bash
# The 2-GPU demonstration (docs/INTEGRATION.md, "Distributed engines"): scripts/multi_gpu_run.py under torchrun,
# NCCL, one process per GPU, at DeepSeek-V4-Flash's compressor shapes. The runs:
#   dp ring    data-parallel attention, LightLLM's C128 ring state
#   dp online  the same with the online HCA banks
#   tp ring    tensor-parallel replicas, which must hold byte-identical pools and state (the ops called
#              through torch.ops.dsv4c)
# Each run writes $OUT/multi_gpu_<mode>_<hca>.json and .log. $OUT is the device tool's output folder, or ./out.
# It exits non-zero if any run fails, and exits 2 on a machine with fewer than 2 GPUs.
#
#   bash scripts/multi_gpu_check.sh [extra multi_gpu_run.py args...]
#
# Environment: PYTHON (default python3); TP_HCA (ring | online: the HCA state of the TP run, default ring);
# RUN_TIMEOUT (seconds per run, default 240) and TOTAL_TIMEOUT (seconds for all runs, default 560: the device
# tool's commands stop at 10 minutes); CPU_SMOKE=1 runs the same three runs on the CPU (gloo, Triton
# interpreter, scaled-down shapes), which checks this script without GPUs.
. "$(dirname "$0")/device_env.sh"
unset TORCH_NCCL_BLOCKING_WAIT
# Keep NVLink multicast off: the device notes ask for this on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Deterministic cuBLAS workspaces, for the TP replicas' bf16 GEMMs.
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
NPROC=2
device_args=()
if [ "${CPU_SMOKE:-0}" = 1 ]; then
  export TRITON_INTERPRET=1
  device_args=(--backend gloo --device cpu --small --requests 3 --max-prompt 48 --decode-steps 3 --chunk 48
               --csa-layers 1 --hca-layers 1 --hidden 64 --timing-samples 1 --timing-inner 1)
  ngpu=$NPROC
else
  ngpu=$($PY -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
fi
if [ "${ngpu:-0}" -lt "$NPROC" ]; then
  echo "multi_gpu_check: needs $NPROC CUDA GPUs, found ${ngpu:-0}; nothing run"
  exit 2
fi
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  echo "commit: ${DSV4_COMMIT:-unknown}"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  nvidia-smi topo -m 2>/dev/null | head -n 5
  $PY -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton",
triton.__version__, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)'
} > "$OUT/multi_gpu_summary.txt" 2>&1
cat "$OUT/multi_gpu_summary.txt"
extra=(${device_args[@]+"${device_args[@]}"} "$@")
status=0
deadline=$(( $(date +%s) + ${TOTAL_TIMEOUT:-560} ))
for run in "dp ring" "dp online" "tp ${TP_HCA:-ring}"; do
  mode=${run% *} hca=${run#* }
  name="multi_gpu_${mode}_${hca}"
  left=$(( deadline - $(date +%s) ))
  limit=${RUN_TIMEOUT:-240}
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$left" -lt 30 ]; then
    echo "== $name: NOT RUN, the time budget (TOTAL_TIMEOUT) is spent" | tee -a "$OUT/multi_gpu_summary.txt"
    status=1
    continue
  fi
  echo "== $name: torchrun --nproc-per-node $NPROC scripts/multi_gpu_run.py --mode $mode --hca $hca" \
    "$([ "$mode" = tp ] && echo --dispatch torch-ops) ${extra[*]:-}"
  start=$(date +%s)
  timeout --kill-after=15 "$limit" $PY -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    scripts/multi_gpu_run.py --mode "$mode" --hca "$hca" --json "$OUT/$name.json" \
    $([ "$mode" = tp ] && echo --dispatch torch-ops) ${extra[@]+"${extra[@]}"} \
    > "$OUT/$name.log" 2>&1
  rc=$?
  echo "   exit $rc after $(( $(date +%s) - start )) s (log: $OUT/$name.log)"
  grep -v '^W[0-9]' "$OUT/$name.log" | grep -A 12 '^multi_gpu_run:' | tee -a "$OUT/multi_gpu_summary.txt"
  if [ "$rc" != 0 ]; then
    status=1
    echo "   FAILED ($name, exit $rc); the log's end:" | tee -a "$OUT/multi_gpu_summary.txt"
    tail -n 30 "$OUT/$name.log" | tee -a "$OUT/multi_gpu_summary.txt"
  fi
done
echo "multi_gpu_check: $([ $status = 0 ] && echo OK || echo FAILED)" | tee -a "$OUT/multi_gpu_summary.txt"
exit $status
