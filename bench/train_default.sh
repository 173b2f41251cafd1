#!/usr/bin/env bash
# Build the training corpus of the shipped forecaster into runs/ and train it (manager/models/default.pt).
#
#   bench/train_default.sh corpus          convert MIGPerf, derive the serving and training-job series
#   bench/train_default.sh train OUT [ARGS]  train on the corpus (extra ARGS go to `vgpu train`)
#   bench/train_default.sh                 both, writing runs/default-candidate.pt
#
# Every input is permitted for a shipped model (../shared/data/README.md): MIGPerf (MIT, real), the Azure
# LLM 2023 (CC-BY-4.0) and Mooncake (Apache-2.0) request traces through the engine model with the Splitwise
# table (MIT), and training jobs composed from MIGPerf/MISO (MIT), GPUMemNet (CC-BY-4.0), Pollux and Zeus
# (Apache-2.0) and PAI mini-batch times (CC-BY-4.0). TITAN X and Lucid are never read here. Every generator
# is seeded, so a rerun writes the same files. Splits are vgpu.offline.splits' (by run family; a serving
# replica and a training job are each their own family), so whole series are held out for val and test.
# The azure-code service is derived but never trained on: it is the held-out service of the evaluation.
# Runs on one CPU thread at nice 10 (the development machine is shared); set THREADS / NICE to change.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-../shared/data}
PY=${PY:-python}
THREADS=${THREADS:-1}
NICE=${NICE:-10}
SERVING_S=${SERVING_S:-1200}   # each serving replica: the first 20 minutes after start-up
TRAINING_JOBS=${TRAINING_JOBS:-48}
vgpu() { PYTHONPATH=$PWD nice -n "$NICE" "$PY" -m vgpu.cli "$@"; }

corpus() {
    mkdir -p runs
    vgpu trace convert --format migperf --src "$DATA/migperf-a100-mig/data" --out runs/migperf.csv.gz
    vgpu trace synth --kind serving --service azure-code --duration-s "$SERVING_S" --seed 0 \
        --data "$DATA" --out runs/serving_code.csv.gz
    vgpu trace synth --kind serving --service azure-conv --duration-s "$SERVING_S" --seed 0 \
        --data "$DATA" --out runs/serving_conv.csv.gz
    vgpu trace synth --kind serving --service mooncake --tp 8 --duration-s "$SERVING_S" --seed 0 \
        --data "$DATA" --out runs/serving_mooncake.csv.gz
    vgpu trace synth --kind training --jobs "$TRAINING_JOBS" --seed 0 --data "$DATA" --out runs/training.csv.gz
}

train() {
    local out=$1; shift
    vgpu train --trace runs/migperf.csv.gz --trace runs/serving_conv.csv.gz \
        --trace runs/serving_mooncake.csv.gz --trace runs/training.csv.gz --out "$out" --threads "$THREADS" \
        --licence "MIT: MIGPerf (../shared/data/migperf-a100-mig, github.com/MLSysOps/MIGProfiler data/ at e377b46), real" \
        --licence "derived: vgpu trace synth --kind serving from Azure LLM 2023 conversation (CC-BY-4.0), Mooncake FAST25 (Apache-2.0), Splitwise perf model (MIT)" \
        --licence "derived: vgpu trace synth --kind training from MIGPerf, MISO (MIT), GPUMemNet (CC-BY-4.0), Pollux, Zeus (Apache-2.0), PAI mini-batch times (CC-BY-4.0)" \
        "$@"
}

case "${1:-all}" in
    corpus) corpus ;;
    train) shift; train "$@" ;;
    all) corpus; train runs/default-candidate.pt --feature-version 5 --stride 2 --epochs 60 --seed 1 --max-minutes 28 --quiet ;;
    *) echo "usage: $0 [corpus | train OUT [vgpu train args] | all]" >&2; exit 2 ;;
esac
