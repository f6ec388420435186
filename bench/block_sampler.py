"""Block-by-block sampling of a block-wise diffusion model with its exact key/value cache,
against the same sampler running the whole canvas at every step (issue 57).

    .venv/bin/python bench/block_sampler.py [--flavor F] [--lengths 256,1024] [--block 32]
        [--prompt 16] [--repeats 3] [--checkpoint RUN] [--threads N] [--smoke]

A block-wise model (``--objective.recipe block``) attends to its own block and the clean blocks
before it, so the finished blocks' keys and values never change: ``--cache block`` computes them
once (a clean pass when a block is finished) and a step runs the block alone. ``--cache none``
runs the whole canvas under the block-causal mask at each step: the same function, the reference.
Each length samples one token per step (steps = length), greedy, both ways in turn
(``--repeats`` rounds; the median), and prints tokens/s, the speed-up and whether the texts are
the same. Untrained weights unless ``--checkpoint`` names a block-wise run: speed does not
depend on them. On CUDA it runs on the GPU. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from muloco import compat

compat.apply()

from muloco.models import ModelConfig, init_model  # noqa: E402
from muloco.objectives.sampling import DiffusionSampling, sample_block_diffusion  # noqa: E402


def _model(args, device):
    if args.checkpoint:
        from muloco.trained_model import load_config, load_model, locate

        run, step = locate(args.checkpoint, None, None)
        config = load_config(run)
        model, tokenizer, objective, *_ = load_model(run, config, step, device)
        if not objective.recipe.block_size:
            raise SystemExit(f"{args.checkpoint} is not a block-wise model (--objective.recipe block)")
        return model, tokenizer.mask_id, objective.recipe.block_size
    torch.manual_seed(0)
    return init_model(ModelConfig(flavor=args.flavor), 2048, causal=False, device=device).eval(), 2047, args.block


def _timed(model, prompt, mask, how, block, device) -> tuple[float, list[int]]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    tokens = sample_block_diffusion(
        model, [prompt], mask, how, torch.Generator(device=device).manual_seed(0), device, block_size=block
    )[0]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - began, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="llama3-w128-d4-h2")
    p.add_argument("--lengths", default="256,1024")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.flavor, args.lengths, args.block, args.repeats = "llama3-w64-d2-h2", "32,64", 16, 1
        args.threads = args.threads or 1
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, mask, block = _model(args, device)
    prompt = [0, *range(10, 10 + args.prompt - 1)]
    print(
        f"block-wise sampling, {args.flavor if not args.checkpoint else args.checkpoint}, block {block}, "
        f"prompt {args.prompt}, one token per step, greedy, {device.type}, {torch.get_num_threads()} threads"
    )
    print(f"{'length':>7}{'whole canvas tok/s':>20}{'block cache tok/s':>19}{'speed-up':>10}{'same text':>11}")
    with torch.no_grad():
        for length in (int(x) for x in args.lengths.split(",")):
            times: dict[str, list[float]] = {"none": [], "block": []}
            texts = {}
            for _ in range(args.repeats):
                for cache in ("none", "block"):
                    how = DiffusionSampling(length=length, steps=length, block_length=block, cache=cache)
                    seconds, texts[cache] = _timed(model, prompt, mask, how, block, device)
                    times[cache].append(seconds)
            whole, cached = (length / statistics.median(times[c]) for c in ("none", "block"))
            print(
                f"{length:>7}{whole:>20,.1f}{cached:>19,.1f}{cached / whole:>9.2f}x"
                f"{'yes' if texts['none'] == texts['block'] else 'no':>11}"
            )


if __name__ == "__main__":
    main()
