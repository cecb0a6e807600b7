#!/usr/bin/env bash
# What a lent GPU machine checks, in one run: the GPT-2-small benchmark, then every test that needs CUDA
# (they skip without it): the composed loop against Accelerate's on the GPU (fp32, bf16, fp16), host syncs,
# FSDP2 in bf16, fp8 through torchao, DeepSpeed ZeRO-2/3, outputs_to_fp32=False, a compiled step; last, compiled
# against hand-written compiled loops (bench_compile.py: the tiny MLP and GPT-2 small).
#
#   benchmarks/gpu_checks.sh OUTDIR          # writes OUTDIR/gpt2.json, OUTDIR/tests.log, OUTDIR/compile.json
#
# Run from the repository root with the machine's own python3 (torch, Accelerate, transformers). Packages the
# machine lacks travel in .gpu/ (ignored by git): wheels (torchao for fp8; DeepSpeed's pydantic, hjson) and
# site/ (DeepSpeed, which PyPI ships only as a source distribution: copied from .deepspeed-site). Without .gpu/
# the fp8 and DeepSpeed tests skip.
set -u
out=${1:?give a folder for the results}
mkdir -p "$out"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
if [ -d .gpu ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-site .gpu/*.whl || exit
    cp -r .gpu/site/. /tmp/gpu-site/
    export PYTHONPATH="$PYTHONPATH:/tmp/gpu-site"
fi
nvidia-smi -L
python3 -c "import torch, accelerate, transformers; print('torch', torch.__version__, 'accelerate', accelerate.__version__, 'transformers', transformers.__version__)"
python3 benchmarks/bench_gpt2.py --json "$out/gpt2.json" | tail -40
python3 -m pytest -q -p no:cacheprovider -W ignore::SyntaxWarning -k "cuda or gpu or fp8 or fp16" -o addopts="" --durations 15 \
    tests/test_precision.py tests/test_equivalence.py tests/test_performance.py tests/test_gpu_engines.py tests/test_deepspeed.py \
    tests/test_bad_input.py tests/test_streams.py tests/test_watch.py 2>&1 | tee "$out/tests.log" | tail -60
python3 benchmarks/bench_compile.py --models tiny gpt2-small --steps 20 --rounds 3 --json "$out/compile.json" | tail -60
