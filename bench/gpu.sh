#!/usr/bin/env bash
# The checks that need a GPU, as one script for a machine with CUDA (run from the repository root):
#   1. the 17-architecture conformance test (tests/ingest/test_architectures.py) and the detectors' on the GPU: features,
#      scalars and head surgery through the GPU's torch branches against the same device's eager maps;
#   2. bench/features.py on the GPU (headcat / SDPA ratios; headcat's extraction takes the Triton fused path
#      from 256 tokens): BERT-base and BERT-large shapes (random weights) at 128 and 512 tokens, and the GQA
#      decoder at 512, 2048 and 4096 tokens (with a detection run at 4096);
#   3. bench/fused_triton.py: one attention layer, the fused path's Triton kernel (output and every stored
#      per-head sum, ingest/fused/triton_kernel.py) against SDPA, BERT-base and the GQA decoder at 512 and 4096
#      tokens, after checking it against the eager reference on the GPU (needs triton: pip install triton), then
#      its launch choices (--sweep: blocks, warps, precision), each checked and timed against SDPA.
# It needs no database and no hub: give it a tokenizer directory and a corpus file, e.g. the packaged
# MiniLM's tokenizer files and `builtin:wiki` written out as JSONL:
#   bash bench/gpu.sh TOKENIZER_DIR CORPUS.jsonl [OUT_DIR]
set -uo pipefail
tokenizer=${1:?a tokenizer directory}; corpus=${2:?a corpus file}; out=${3:-${OUT:-bench/out}}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import torch, transformers, numba; print('torch', torch.__version__, 'transformers', transformers.__version__, 'numba', numba.__version__)"
status=0
echo "== conformance on cuda"
HEADCAT_TEST_DEVICE=cuda $py -m pytest --noconftest -p no:cacheprovider -o filterwarnings= -q -rf \
    tests/ingest/test_architectures.py tests/ingest/test_detectors.py 2>&1 | tee "$out/conformance.log" | tail -25 || status=1
echo "== features on cuda"
for shape in bert-base bert-large; do
    $py bench/features.py --device cuda --random-config "$shape" --tokenizer "$tokenizer" --corpus "$corpus" \
        --max-length 128 512 --samples 512 --batch-size 32 --repeats 5 --json "$out/features-$shape.json" \
        2>&1 | tee "$out/features-$shape.log" || status=1
done
$py bench/features.py --device cuda --gqa-decoder --tokenizer "$tokenizer" --corpus "$corpus" \
    --max-length 512 2048 --samples 256 --batch-size 16 --repeats 5 2>&1 | tee "$out/features-gqa.log" || status=1
# headcat's fused extraction (the Triton kernel: choose_reduction picks it on CUDA from 256 tokens) / SDPA at 4k
# tokens for the GQA decoder (BERT-base has 512 positions: its 512-token ratio is the bert-base run's above)
$py bench/features.py --device cuda --gqa-decoder --no-eager --detect --tokenizer "$tokenizer" --corpus "$corpus" \
    --max-length 4096 --samples 32 --batch-size 4 --repeats 3 2>&1 | tee "$out/features-gqa-4k.log" || status=1
echo "== fused Triton kernel on cuda"
$py bench/fused_triton.py --lengths 512 4096 --repeats 10 --json "$out/fused-triton.json" \
    2>&1 | tee "$out/fused-triton.log" || status=1
echo "== the Triton kernel's launch choices on cuda"
$py bench/fused_triton.py --sweep --lengths 512 4096 --repeats 3 --json "$out/fused-triton-sweep.json" \
    2>&1 | tee "$out/fused-triton-sweep.log" || status=1
exit $status
