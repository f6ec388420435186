"""Masked-diffusion generation speed: muloco's sampler against LLaDA's algorithm written plainly.

    .venv/bin/python bench/generate.py [--checkpoint RUN_FOLDER] [--flavor F] [--length 64]
        [--blocks 8 16 32 64] [--batches 1 8] [--short 8] [--threshold 0.9] [--repeats 3]
        [--threads 1] [--device auto] [--json PATH] [--smoke]

The reference (:func:`reference_generate`) is LLaDA's ``generate.py`` loop as its README gives
it, on the same model: the canvas is the prompt and ``length`` masks, each semi-autoregressive
block gets ``steps / blocks`` steps, each step runs the whole canvas, draws Gumbel noise for
every logit in float64 (temperature > 0), takes the softmax probability of the chosen token
as its confidence and commits the top-k masked positions of the block (k: the block's masks
split evenly over its steps, the remainder first). The mask token's logit is −∞ in both.

For each block length (``steps`` = ``length``) and batch size the bench times, round-robin
over ``--repeats`` rounds: the reference, muloco's sampler with the same settings (its output
must be the reference's token for token: "same" in the table), and the sampler with
``--threshold`` (Fast-dLLM's confidence-threshold parallel decoding: every masked position of
the block at least that sure is filled in one step), with the prefix cache (Fast-dLLM's: the
finished part of the canvas runs once per block), with both, and with the dual cache (the
masked blocks after the block are kept too: a step runs the block alone). Each gets its speed-up over
the plain sampler ("x") and its agreement with the plain greedy output (the share of generated
tokens that are equal). Rows with ``--short`` tokens show the
speed-up where Fast-dLLM users report it vanishes. Tokens/s count generated tokens of all rows
of a batch. With ``--checkpoint`` (an mdlm run folder) the model is trained and the prompts are
the starts of held-out documents; without one it is a fresh model (its confidences are low,
so a threshold rarely fires: give a checkpoint for real figures). ``--json PATH`` appends one
JSON line per row (``bench/gpu_suite.py`` reads them). ``--smoke`` (CI): a tiny fresh model,
one block length, one round. Nothing here asserts on timing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from muloco import compat  # noqa: E402

compat.apply()

import torch  # noqa: E402

from muloco.data.loader import PackedTextDataLoader  # noqa: E402
from muloco.data.tokenizer import MulocoTokenizer  # noqa: E402
from muloco.models import ModelConfig, init_model  # noqa: E402
from muloco.objectives.sampling import DiffusionSampling, sample_diffusion_batch  # noqa: E402

PROMPT_TOKENS = 16
VARIANTS = ("threshold", "prefix", "prefix+threshold", "dual")
"""The sampler's speed options, each timed against the plain sampler ("x": its speed-up)."""


@torch.no_grad()
def reference_generate(
    model,
    prompts: torch.Tensor,
    mask_id: int,
    length: int,
    steps: int,
    block_length: int,
    temperature: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """LLaDA's ``generate`` (low-confidence remasking) for prompts of one length: ``(B, length)``."""
    b, p = prompts.shape
    x = torch.full((b, p + length), mask_id, dtype=torch.long, device=prompts.device)
    x[:, :p] = prompts
    blocks = length // block_length
    steps_per_block = steps // blocks
    for n in range(blocks):
        start, end = p + n * block_length, p + (n + 1) * block_length
        masks = (x[:, start:end] == mask_id).sum(dim=1, keepdim=True)
        transfer = (masks // steps_per_block).repeat(1, steps_per_block)
        for row in range(b):
            transfer[row, : int(masks[row] % steps_per_block)] += 1
        for i in range(steps_per_block):
            mask_index = x == mask_id
            logits = model(x).float()
            logits[..., mask_id] = -math.inf
            if temperature > 0:  # LLaDA's add_gumbel_noise: exp(logits) / (−log u)^T in float64
                u = torch.rand(logits.shape, generator=generator, dtype=torch.float64, device=logits.device)
                x0 = (logits.double().exp() / (-torch.log(u.clamp_min(1e-300))) ** temperature).argmax(dim=-1)
            else:
                x0 = logits.argmax(dim=-1)
            p_x0 = torch.softmax(logits.double(), dim=-1).gather(-1, x0.unsqueeze(-1)).squeeze(-1)
            p_x0[:, end:] = -math.inf
            confidence = torch.where(mask_index, p_x0, torch.full_like(p_x0, -math.inf))
            commit = torch.zeros_like(x0, dtype=torch.bool)
            for row in range(b):
                k = int(transfer[row, i])
                if k:
                    commit[row, confidence[row].topk(k).indices] = True
            x[commit] = x0[commit]
    return x[:, p:]


def _model_and_prompts(args, device):
    tokenizer = MulocoTokenizer()
    if args.checkpoint:
        from muloco.trained_model import load_config, load_model, locate

        run, step = locate(args.checkpoint, 0, None)
        config = load_config(run)
        model, tokenizer, objective, _, _ = load_model(run, config, step, device)
        if objective.causal:
            raise SystemExit(f"{args.checkpoint} is an autoregressive run; give a masked-diffusion (mdlm) run")
    else:
        torch.manual_seed(0)
        model = init_model(ModelConfig(flavor=args.flavor), tokenizer.get_vocab_size(), False, device).eval()
    loader = PackedTextDataLoader.Config(next_token=False, split="validation").build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=PROMPT_TOKENS, local_batch_size=max(args.batches)
    )
    prompts = next(iter(loader))[0]["input"].to(device)
    prompts[:, 0] = tokenizer.bos_id
    return model, tokenizer, prompts


def _timed(fn, device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - began, out


def _case(model, prompts, mask_id, length, block, threshold, repeats, device):
    """Median seconds of the reference and of the sampler plain, with a threshold, with the prefix
    cache, with both and with the dual cache; whether the plain sampler equals the reference; each variant's agreement
    with the plain greedy output."""
    rows = [p.tolist() for p in prompts]

    def sampler(**options):
        how = DiffusionSampling(length=length, steps=length, block_length=block, **options)
        return lambda: torch.tensor(
            sample_diffusion_batch(model, rows, mask_id, how, torch.Generator(device=device), device)
        )

    runs = {
        "reference": lambda: reference_generate(
            model, prompts, mask_id, length, length, block, 0.0, torch.Generator(device=device)
        ),
        "sampler": sampler(),
        "threshold": sampler(threshold=threshold),
        "prefix": sampler(cache="prefix"),
        "prefix+threshold": sampler(cache="prefix", threshold=threshold),
        "dual": sampler(cache="dual"),
    }
    seconds = {name: [] for name in runs}
    outputs = {}
    for _ in range(repeats):
        for name, fn in runs.items():
            s, outputs[name] = _timed(fn, device)
            seconds[name].append(s)
    same = torch.equal(outputs["reference"].cpu(), outputs["sampler"].cpu())
    agreement = {k: (outputs[k].cpu() == outputs["sampler"].cpu()).float().mean().item() for k in VARIANTS}
    return {k: statistics.median(v) for k, v in seconds.items()}, same, agreement


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None, help="an mdlm run folder (default: a fresh --flavor model)")
    p.add_argument("--flavor", default="llama3-w128-d4-h2")
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--blocks", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--short", type=int, default=8, help="also time outputs this long (one block)")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (0: torch's default)")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default=None, help="append one JSON line per row to this file")
    p.add_argument("--smoke", action="store_true", help="a tiny model, one block length, one round (CI)")
    args = p.parse_args()
    from machine import exit_on_sigterm  # bench/ is on sys.path when a bench runs; tests import this file

    exit_on_sigterm()
    if args.smoke:
        args.flavor, args.length, args.blocks, args.batches, args.short, args.repeats = (
            "llama3-w64-d2-h2",
            16,
            [8],
            [1, 2],
            8,
            1,
        )
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, prompts = _model_and_prompts(args, device)
    cases = [(args.length, block) for block in args.blocks if args.length % block == 0]
    cases += [(args.short, args.short)] if args.short and args.short != args.length else []
    print(
        f"generation on {device} ({torch.get_num_threads()} threads), prompts of {PROMPT_TOKENS} tokens, "
        f"steps = length, threshold {args.threshold}, median of {args.repeats}; "
        f"model: {args.checkpoint or 'fresh ' + args.flavor}"
    )
    header = ["length", "block", "batch", "reference tok/s", "sampler tok/s", "ratio", "same"]
    header += [f"{v} {what}" for v in VARIANTS for what in ("x", "agree")]
    table = [header]
    for batch in args.batches:
        for length, block in cases:
            seconds, same, agreement = _case(
                model, prompts[:batch], tokenizer.mask_id, length, block, args.threshold, args.repeats, device
            )
            tps = {k: batch * length / s for k, s in seconds.items()}
            if args.json:
                with open(args.json, "a") as f:
                    f.write(
                        json.dumps(
                            {
                                "table": "generate",
                                "length": length,
                                "block": block,
                                "batch": batch,
                                "device": device.type,
                                "model": args.checkpoint or args.flavor,
                                "tokens_per_s": tps,
                                "same": same,
                                "agreement": agreement,
                            }
                        )
                        + "\n"
                    )
            table.append(
                [
                    str(length),
                    str(block),
                    str(batch),
                    f"{tps['reference']:,.0f}",
                    f"{tps['sampler']:,.0f}",
                    f"{tps['sampler'] / tps['reference']:.2f}",
                    "yes" if same else "NO",
                ]
                + [cell for v in VARIANTS for cell in (f"{tps[v] / tps['sampler']:.2f}", f"{agreement[v]:.1%}")]
            )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    return 0 if all(r[6] == "yes" for r in table[1:]) else 1


if __name__ == "__main__":
    sys.exit(main())
