#!/usr/bin/env bash
# The GPU checks in one run, for a machine with CUDA, PyTorch, Numba and numba-cuda installed
# (CI has no GPU; see README "On a GPU"). Logs and tables go to $OUT (default: ./gpu_out).
#   [BUDGET_S=N] bash benchmarks/gpu_check.sh [step ...]
#   default: profile train   (about 7 minutes: BUDGET_S=465 and the device tool's timeout 480)
#   then at once, while the machine is warm: quant user tests hooks overhead kernels buckets
#   hybrid library compress   (as many as the device time left allows, in that order)
# (on an H200: profile 139 s for both models in one process, train 231 s, quant 37 s, user
#   69 s, tests 20 s, overhead 32 s, the hook's CPU == CUDA tests 97 s, a hybrid row 40 s)
# quant: the quant GPU tests (native fp16/bf16/tf32/int8/fp8 operators, kernels and dtypes per
#   op, launches of a bf16 BERT against torch.autocast)
# profile: qsync-lab profile --device cuda of BERT-base and of ResNet-50 at batch 32 in every
#   precision, each calibrated to the model's own steps ($OUT/gpu_profile_<model>.csv), which
#   the train, user and hybrid steps predict from as well
# train: benchmarks/gpu_training.py, the training step of BERT-base, ResNet-50 and a GPT decoder
#   under each plan (fp32 ... fp8, qsync) beside plain torch (eager, TF32, autocast), measured
#   against the simulator's prediction; its table is $OUT/gpu_training.txt and .csv (two rounds of
#   every row, in turn: the host's pace drifts; rows that start after 220 s are skipped)
# tests, kernels, buckets, hooks: the CUDA kernels and the compression hook
#   (HOOKS_SELECT: a pytest -k expression for the hooks step; HOOKS_LIMIT: its seconds); the
#   bucket table predicts each hook's encode + decode from the compress step's profile when
#   this call ran it, else from the catalog's roofline
# compress: qsync-lab profile --device cuda --compress: the compressors' encode and decode
#   through the hook's CUDA kernels at 64 K-16 M elements ($OUT/gpu_compress.csv)
# user: the user's path on this GPU: qsync-lab plan (BERT-base, one rank of the card's kind,
#   --throughput 600, else 95 % of the best the GPU profile reaches) and qsync-lab run
#   --steps 30; its summary gives the measured step beside the prediction
# hybrid: benchmarks/hybrid_gpu.py, the GPU split into a fast and a slow partition (green
#   contexts under MPS), each strategy trained and predicted ($OUT/hybrid_gpu.csv; the runs
#   themselves under $WORK; HYBRID_BUDGET: its seconds, 200)
# overhead: benchmarks/op_overhead.py, the host's cost of one op (tiny linear, conv, matmul)
#   in each plan precision beside eager, TF32 and autocast ($OUT/op_overhead.txt)
# library: the library models (transformers: GPT-2, BERT, T5, ViT, Swin, ResNet) on CUDA: a bf16
#   plan's GEMMs multiply bf16 operands, every plannable op profiled in-step in fp32 and bf16
# Each step has its own time limit, so one stuck step cannot hide the others' results: at
# the limit it gets SIGINT (pytest then prints its failures, a run stops its ranks), 20 s
# later SIGKILL. The logs (the runs' own launch logs among them) are packed into
# $OUT/logs.tgz after every step, so a call cut short still returns them (the device tool
# returns at most 8 files). An MPS daemon the hybrid step left is stopped on exit.
set -u
OUT=${OUT:-gpu_out}
WORK=${WORK:-$(mktemp -d)}
LOGS=$WORK/logs
mkdir -p "$OUT" "$WORK" "$LOGS"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
STEPS=${*:-profile train}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

pack_logs() {
    (cd "$LOGS" && tar czf "$OUT/logs.tgz.part" ./*.log 2> /dev/null) \
        && mv "$OUT/logs.tgz.part" "$OUT/logs.tgz"
}

# BUDGET_S (optional): the seconds this call may take in all (the device tool's timeout_s,
# less a margin); a step then gets at most what is left of it, and is skipped under 30 s
BUDGET_S=${BUDGET_S:-}
step() {  # step NAME SECONDS COMMAND...: run it, log it, say how it ended
    local name=$1 limit=$2 begin=$SECONDS
    shift 2
    if [ -n "$BUDGET_S" ]; then
        local left=$((BUDGET_S - SECONDS - 25))  # 25 s: the SIGKILL's grace and the packing
        if [ "$left" -lt 30 ]; then
            echo "== $name: skipped ($((BUDGET_S - SECONDS)) s of BUDGET_S=$BUDGET_S left)"
            return
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    timeout -s INT -k 20 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - begin)) s (limit $limit s)"
    tail -n 25 "$LOGS/$name.log"
    pack_logs
}

mps_running() { pgrep -x nvidia-cuda-mps-control > /dev/null 2>&1; }
mps_before=no
mps_running && mps_before=yes
stop_left_mps() {  # the hybrid step starts MPS for its runs; a cut step may leave it
    if [ "$mps_before" = no ] && mps_running; then
        echo quit | nvidia-cuda-mps-control > /dev/null 2>&1
        echo "stopped the MPS daemon the hybrid step left"
    fi
}
trap 'stop_left_mps; pack_logs' EXIT
trap 'exit 143' TERM INT

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    $PY -c "import torch, numba; from importlib.metadata import version
def installed(name):
    try:
        return version(name)
    except Exception:
        return 'missing'
print('torch', torch.__version__, 'numba', numba.__version__, 'numba-cuda',
      installed('numba-cuda'), 'transformers', installed('transformers'), 'nccl',
      torch.cuda.nccl.version(), 'cpus', __import__('os').cpu_count())"
} 2>&1 | tee "$LOGS/env.log"
if ! $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$LOGS/install.log" 2>&1
then  # the package's layout by links: qsync_lab/, with kernels/ and data/ inside it
    echo "pip install failed ($(tail -n 1 "$LOGS/install.log")): using a linked tree"
    tree=$(mktemp -d) && cp -rs "$PWD/qsync_lab" "$tree/" \
        && ln -s "$PWD/kernels" "$tree/qsync_lab/kernels" && ln -s "$PWD/data" "$tree/qsync_lab/data"
    export PYTHONPATH=$tree:$PWD
fi
# numba-cuda 0.30 registers np.row_stack, which numpy 2.5 removed (the lent image pairs them):
# alias it to np.vstack in every process of this run, before numba.cuda loads
if ! $PY -c "import numpy; numpy.row_stack" 2> /dev/null; then
    shim=$(mktemp -d)
    printf 'import numpy\nnumpy.row_stack = numpy.vstack\n' > "$shim/sitecustomize.py"
    export PYTHONPATH=$shim${PYTHONPATH:+:$PYTHONPATH}
    echo "numpy $($PY -c 'import numpy; print(numpy.__version__)') has no row_stack: aliased"
fi
# numba-cuda needs libNVVM: from the toolkit's pip wheels, else from CUDA_HOME
smoke='from numba import cuda; import numpy as np
@cuda.jit
def k(a): a[cuda.grid(1)] += 1
a = cuda.to_device(np.zeros(64, np.float32)); k[1, 64](a); assert a.copy_to_host().sum() == 64
print("numba-cuda kernel ran")'
if ! smoked=$($PY -c "$smoke" 2>&1) && [ -d /usr/local/cuda ]; then
    echo "$smoked" | tail -1
    export CUDA_HOME=/usr/local/cuda
    smoked=$($PY -c "$smoke" 2>&1)
fi
echo "$smoked" | tail -1

profile_models() {  # one profile per model: each is calibrated to its own model's steps
    local model
    for model in bert_base resnet50; do
        $PY -m qsync_lab profile --device cuda --model "$model" --batch 32 \
            --precisions fp32,tf32,bf16,fp16,int8,fp8_e4m3 --repeats 5 \
            --out "$OUT/gpu_profile_$model.csv" || return
    done
}

user_path() {  # plan and run BERT-base on one rank of this GPU's catalog kind
    local kind
    kind=$($PY -c "from qsync_lab.profile.device import profile_device_name as n; print(n('cuda'))")
    printf 'name = "one-gpu"\nbatch_size = 32\n\n[[node]]\nname = "n0"\nintra_node_link = "nvlink4"\ndevices = [{ kind = "%s", count = 1 }]\n' \
        "$kind" > "$WORK/one-gpu.toml"
    local target=600 best
    until $PY -m qsync_lab plan --model bert_base --cluster "$WORK/one-gpu.toml" \
        --throughput "$target" ${GPU_PROFILE:+--profile "$GPU_PROFILE"} \
        --out "$WORK/plan.json" 2> "$WORK/plan.err"; do
        cat "$WORK/plan.err"  # refused: plan once more, for 95 % of the best it can reach
        best=$(sed -n 's/.*(\([0-9.]*\) samples\/s), target.*/\1/p' "$WORK/plan.err")
        [ -n "$best" ] && [ "$target" = 600 ] || return 1
        target=$(awk -v b="$best" 'BEGIN { printf "%.0f", 0.95 * b }')
    done
    $PY -m qsync_lab run --plan "$WORK/plan.json" --steps 30 --checkpoint-every 0 \
        --run-dir "$WORK/user_run" ${GPU_PROFILE:+--profile "$GPU_PROFILE"}
}
export -f profile_models user_path
export PY WORK OUT

# no nbval or doctests there; the image's own warnings (numba-cuda's occupancy hints) are
# reported, not turned into errors
PYTEST=($PY -m pytest -q -p no:cacheprovider -o addopts=-ra -W default --gpu)
for name in $STEPS; do
    [ -s "$OUT/gpu_profile_bert_base.csv" ] && GPU_PROFILE="$OUT/gpu_profile_bert_base.csv"
    TRAIN_PROFILES=()  # each model's own profile
    for model in bert_base resnet50; do
        [ -s "$OUT/gpu_profile_$model.csv" ] &&
            TRAIN_PROFILES+=(--profile "$model=$OUT/gpu_profile_$model.csv")
    done
    [ -s "$OUT/gpu_compress.csv" ] && COMPRESS_PROFILE="$OUT/gpu_compress.csv"
    case $name in
        quant) step quant 60 "${PYTEST[@]}" -m gpu tests/quant ;;
        profile) step profile 230 bash -c profile_models ;;
        train) step train 260 $PY benchmarks/gpu_training.py --kernels --rounds 2 --row-s 3 \
                   --budget-s 220 \
                   --out "$OUT" ${TRAIN_PROFILES[@]+"${TRAIN_PROFILES[@]}"} ;;
        tests) step tests 40 "${PYTEST[@]}" tests/kernels/test_cuda_kernels.py ;;
        kernels) step kernels 80 $PY benchmarks/kernels.py --devices cuda --repeats 20 ;;
        buckets) step buckets 40 $PY benchmarks/compression.py --device cuda --worlds 1 \
                     --skip-runs --repeats 20 ${COMPRESS_PROFILE:+--profile "$COMPRESS_PROFILE"} ;;
        compress) step compress 120 $PY -m qsync_lab profile --device cuda --model digits_cnn \
                      --precisions fp32 --repeats 5 --compress --out "$OUT/gpu_compress.csv" ;;
        hooks) step hooks "${HOOKS_LIMIT:-150}" "${PYTEST[@]}" tests/compress/test_hook_cuda.py \
                   ${HOOKS_SELECT:+-k "$HOOKS_SELECT"} ;;
        overhead) step overhead 60 $PY benchmarks/op_overhead.py --device cuda \
                      --out "$OUT/op_overhead.txt" ;;
        library) step library 150 "${PYTEST[@]}" -m gpu tests/models/test_library_models.py ;;
        user) step user 100 env GPU_PROFILE="${GPU_PROFILE:-}" bash -c user_path
              cp "$WORK/user_run/launch.log" "$LOGS/user_launch.log" 2> /dev/null
              pack_logs ;;
        hybrid) step hybrid $((${HYBRID_BUDGET:-200} + 40)) $PY benchmarks/hybrid_gpu.py --steps 30 \
                    --budget-s "${HYBRID_BUDGET:-200}" --out "$WORK/hybrid" \
                    ${GPU_PROFILE:+--profile "$GPU_PROFILE"}
                cp "$WORK"/hybrid/hybrid_gpu.{csv,txt} "$OUT/" 2> /dev/null
                for log in "$WORK"/hybrid/*/launch.log; do
                    run=$(basename "$(dirname "$log")")
                    [ -f "$log" ] && cp "$log" "$LOGS/hybrid_${run}_launch.log"
                done
                stop_left_mps
                pack_logs ;;
        *) echo "unknown step $name" ;;
    esac
done
