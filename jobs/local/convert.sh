#!/usr/bin/env bash
# From an autoregressive model to a diffusion LM with LoRA, under K=2 MuLoCo on this machine:
# a tiny AR model trained with muloco on the embedded corpus and exported (or --from a Hugging
# Face folder: Llama 3.x, Qwen2/2.5, Qwen3), converted with a recipe (--objective.recipe) by
# LoRA adapters only (the base stays frozen and never leaves a group; only the adapters'
# 2-bit pseudo-gradients are exchanged), then exported (merged, and the adapter alone) and sampled.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${MULOCO_PYTHON:-$REPO/.venv/bin/python}"

usage() {
    cat <<USAGE
Usage: jobs/local/convert.sh [--from HF_DIR] [--recipe full|dream|block] [--lora-rank R]
                             [--ar-steps N] [--out DIR] [launcher options] [-- trainer overrides...]

  --from HF_DIR   start from this Hugging Face folder (default: train a tiny AR model with
                  muloco for --ar-steps steps, ddp/adamw, and export it to DIR/ar-hf)
  --recipe NAME   full, dream or block (default block: blocks of 16, an exact KV cache when sampling)
  --lora-rank R   LoRA rank (default 8; 0 fine-tunes every parameter)
  --ar-steps N    steps of the tiny AR model (default 450)
  --out DIR       where the runs and exports go (default ./outputs/convert)
Launcher options (python -m muloco.launch.local --help) and trainer overrides after -- go to the
K=2 run (default --replicas 2); the AR run is ddp/adamw as it is, for --ar-steps steps.

Writes DIR/ar (the AR run), DIR/ar-hf (its export), DIR/diffusion (the K=2 MuLoCo run),
DIR/diffusion-hf (its export: the merged model, and adapter/ for peft), then prints two samples.
Example: jobs/local/convert.sh --recipe dream -- --training.steps 200
USAGE
}

from="" recipe="block" rank=8 ar_steps=450 out="./outputs/convert"
launcher=() overrides=()
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --from) from="$2"; shift 2 ;;
        --recipe) recipe="$2"; shift 2 ;;
        --lora-rank) rank="$2"; shift 2 ;;
        --ar-steps) ar_steps="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --) shift; overrides=("$@"); break ;;
        *) launcher+=("$1"); shift ;;
    esac
done
case "$recipe" in
    full) recipe_flags=() ;;
    dream) recipe_flags=(--objective.weight cart) ;;
    block) recipe_flags=(--objective.recipe.block_size 16) ;;
    *) echo "convert.sh: --recipe must be full, dream or block; got '$recipe'" >&2; exit 2 ;;
esac
mkdir -p "$out"
out="$(cd "$out" && pwd)"

if [ -z "$from" ]; then
    from="$out/ar-hf"
    if [ ! -f "$from/config.json" ]; then
        echo "convert: training a tiny AR model ($ar_steps steps) in $out/ar"
        "$PY" -m muloco.train --config ddp/adamw --training.steps "$ar_steps" --checkpoint.interval "$ar_steps" \
            --dump_folder "$out/ar"
        "$PY" -m muloco.export "$out/ar" --out "$from"
    fi
fi
echo "convert: $from -> a diffusion LM (recipe $recipe, LoRA rank $rank) under K=2 MuLoCo in $out/diffusion"
"$PY" -m muloco.launch.local --config diffusion/muloco_2bit --replicas 2 ${launcher[@]+"${launcher[@]}"} -- \
    --model.flavor "hf:$from" --tokenizer.path "$from" --checkpoint.initial_load_path "$from" \
    --checkpoint.initial_load_in_hf --checkpoint.initial_load_model_only \
    --objective.recipe "$recipe" ${recipe_flags[@]+"${recipe_flags[@]}"} --model.lora.rank "$rank" \
    --dump_folder "$out/diffusion" ${overrides[@]+"${overrides[@]}"}
"$PY" -m muloco.export "$out/diffusion" --out "$out/diffusion-hf" --force
echo "samples from θ_g of $out/diffusion:"
"$PY" -m muloco.generate --checkpoint "$out/diffusion" --prompt "def " --prompt "import " --length 32 --steps 32 \
    --temperature 1.0 --seed 1
