"""Sample from a trained run: ``python -m muloco.generate --checkpoint DIR --prompt "..."``.

``DIR`` is a run's dump folder (a DiLoCo run's: replica 0 unless ``--replica``), one
replica's folder, or a ``checkpoint/step-N`` folder, loaded by :mod:`muloco.trained_model` (the
newest complete checkpoint or ``--step``, verified, nothing unpickled). A DiLoCo run samples
from θ_g, the global model the replicas agreed on. A masked-diffusion run samples by iterative unmasking
(:mod:`muloco.objectives.sampling`:
LLaDA's schedule, or ``--threshold`` parallel decoding, an optional ``--cache prefix|dual``, and
``--batch-size`` prompts at a time), an autoregressive one token by token. The same seed gives
the same text. Options are checked against the run before anything is loaded: a value out of
range or an option the run does not take (a diffusion option on an autoregressive run,
``--replica`` on a run without replica groups) is one error, exit status 2.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Annotated, Literal

from muloco.objectives.sampling_options import CACHES, ORDERS
from muloco.utils.command_line import UsageError, failed, parse, tyro
from muloco.utils.errors import BAD_INPUT, BadInput, MulocoError

# torch and torchtitan are imported once the command line is parsed (``_load``): ``--help`` and a
# usage error answer without them.


class GenerateError(BadInput, ValueError):
    pass


PROG = "python -m muloco.generate"


@dataclass
class GenerateOptions:
    """Sample from a trained run (or score choices)."""

    checkpoint: str
    """Run dump folder, replica folder or checkpoint/step-N."""
    prompt: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """Prompt text (repeat for several samples; default: one empty prompt)."""
    step: int | None = None
    """Checkpoint step (default: the newest complete)."""
    replica: int | None = None
    """DiLoCo run: the replica folder to read (default 0)."""
    length: int = 64
    """Tokens to generate."""
    steps: int | None = None
    """Diffusion: denoising steps (default: --length)."""
    block_length: int | None = None
    """Diffusion: semi-AR block (default: --length; a block-wise model's own block size, the only one it takes)."""
    order: Annotated[Literal[ORDERS] | None, tyro.conf.arg(metavar="{" + ",".join(ORDERS) + "}")] = None
    """Diffusion: which masks to fill first (default confidence)."""
    threshold: float | None = None
    """Diffusion: fill at once every masked position of the block whose token has at least this probability.
    Fast-dLLM's parallel decoding (default: the fixed schedule)."""
    cache: Annotated[Literal[CACHES] | None, tyro.conf.arg(metavar="{" + ",".join(CACHES) + "}")] = None
    """Diffusion: prefix = Fast-dLLM's block-wise prefix cache, dual = its dual cache (default: none).
    The finished part of the canvas (dual: and the masked blocks after) runs once per block; an approximation.
    block = the exact key/value cache of a block-wise model's finished blocks (its default)."""
    batch_size: int | None = None
    """Diffusion: sample this many prompts together, left-padded (default 1)."""
    temperature: float = 0.0
    """0: greedy; > 0: float64 Gumbel sampling."""
    seed: int = 0
    """Random seed: the same seed gives the same text."""
    device: str = "auto"
    """auto (cuda if available), cpu, cuda, cuda:N."""
    score: tyro.conf.UseAppendAction[Annotated[tuple[str, ...], tyro.conf.arg(metavar="CHOICE")]] = ()
    """Instead of sampling, score this continuation of each prompt (repeat for multiple choice); the smallest wins.
    −log p(choice | prompt) in nats: exact for causal models, LLaDA's Monte Carlo bound for diffusion ones."""
    mc_samples: int = 128
    """Diffusion scoring: Monte Carlo rows per choice."""
    json: bool = False
    """Print one JSON object per sample."""


def parse_args(argv: list[str]) -> GenerateOptions:
    """The options, or a UsageError; checked against the run only once it is found (``check_options``)."""
    args, _ = parse(GenerateOptions, argv, prog=PROG, description=__doc__.split("\n\n")[0], overrides=False)
    return args


DIFFUSION_ONLY = {
    "steps": "--steps",
    "block_length": "--block-length",
    "order": "--order",
    "threshold": "--threshold",
    "cache": "--cache",
    "batch_size": "--batch-size",
}
"""Options of the diffusion sampler: an error on an autoregressive run and when scoring."""


def check_options(args: GenerateOptions, causal: bool) -> None:
    """GenerateError naming an option out of range or one that does not apply to this run."""
    given = [flag for name, flag in DIFFUSION_ONLY.items() if getattr(args, name) is not None]
    if causal and given:
        raise GenerateError(
            f"{', '.join(given)}: only for masked-diffusion runs, and this run is "
            f"autoregressive (it samples token by token); leave {'them' if len(given) > 1 else 'it'} out."
        )
    if args.score and given:
        raise GenerateError(
            f"{', '.join(given)}: sampling options, and --score does not sample; leave "
            f"{'them' if len(given) > 1 else 'it'} out or drop --score."
        )
    for name, low in (
        ("length", 1),
        ("steps", 1),
        ("block_length", 1),
        ("batch_size", 1),
        ("mc_samples", 1),
        ("step", 0),
    ):
        value = getattr(args, name)
        if value is not None and value < low:
            raise GenerateError(f"--{name.replace('_', '-')} {value}: must be at least {low}.")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise GenerateError(f"--temperature {args.temperature}: must be a finite number >= 0 (0: greedy).")


def generate(args: GenerateOptions) -> list[dict]:
    # torch-bound, so imported only once the command line parsed (--help and usage errors stay fast)
    from muloco import compat

    compat.apply()  # before torchtitan is imported (idempotent)
    import torch

    from muloco.objectives.recipes import readout_of
    from muloco.objectives.sampling import (
        DiffusionSampling,
        sample_autoregressive,
        sample_model,
        sampling_for,
        until_eos,
    )
    from muloco.trained_model import load_config, load_model, locate

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    run, step = locate(args.checkpoint, args.replica, args.step)
    config = load_config(run, prog=PROG)
    check_options(args, config.objective._owner.causal)
    readout = readout_of(config.objective)
    how = sampling_for(
        DiffusionSampling(
            length=args.length,
            steps=args.steps or args.length,
            temperature=args.temperature,
            order=args.order or "confidence",
            threshold=args.threshold,
        ),
        readout,
        args.block_length,
        args.cache,
    )
    if readout.block_size:
        how.check_block_model(readout.block_size)
    elif not config.objective._owner.causal:
        how.check()
    model, tokenizer, objective, step, global_model = load_model(run, config, step, device)
    prompts = args.prompt or [""]
    facts = {"objective": objective.name, "step": step, "run": str(run)}
    if args.score:
        return [
            _scores(model, objective, tokenizer, prompt, args, i, device, readout) | facts
            for i, prompt in enumerate(prompts)
        ]
    out = []
    batch = 1 if objective.causal else args.batch_size or 1
    for first in range(0, len(prompts), batch):
        generator = torch.Generator(device=device).manual_seed(args.seed + first)
        ids = [tokenizer.encode(p, add_bos=True) for p in prompts[first : first + batch]]
        if objective.causal:
            samples = [
                sample_autoregressive(model, ids[0], tokenizer.eos_id, args.length, args.temperature, generator, device)
            ]
        else:
            samples = sample_model(model, ids, tokenizer.mask_id, how, generator, device, readout)
        out += [
            {
                "prompt": prompt,
                "text": tokenizer.decode(until_eos(tokens, tokenizer.eos_id)),
                "tokens": tokens,
                "weights": "θ_g" if global_model else "model",
            }
            | facts
            for prompt, tokens in zip(prompts[first : first + batch], samples)
        ]
    return out


def _scores(model, objective, tokenizer, prompt: str, args, index: int, device, readout) -> dict:
    import torch

    generator = torch.Generator(device=device).manual_seed(args.seed + index)
    ids = tokenizer.encode(prompt, add_bos=True)
    scores = {c: _score(model, objective, tokenizer, ids, c, args, generator, device, readout) for c in args.score}
    return {"prompt": prompt, "scores": scores, "best": min(scores, key=scores.get)}


def _score(model, objective, tokenizer, prompt_ids, choice, args, generator, device, readout) -> float:
    from muloco.objectives.likelihood import autoregressive_nll, diffusion_nll  # only when --score asks

    target = tokenizer.encode(choice)
    if objective.causal:
        return autoregressive_nll(model, prompt_ids, target, device)
    return diffusion_nll(
        model,
        prompt_ids,
        target,
        tokenizer.mask_id,
        samples=args.mc_samples,
        generator=generator,
        device=device,
        readout=readout,
    )


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(list(sys.argv[1:] if argv is None else argv))
    except UsageError as err:
        return failed("generate", err)
    # torch-bound, so imported only once the command line parsed (--help and usage errors stay fast)
    from muloco import compat

    compat.apply()  # before torchtitan is imported
    try:
        samples = generate(args)
    except MulocoError as err:
        return failed("generate", err)
    except ValueError as err:  # a library's refusal of the input
        return failed("generate", err, BAD_INPUT)
    for s in samples:
        if args.json:
            print(json.dumps(s))
        elif "scores" in s:
            print(f"--- {s['objective']} scores (nats), step {s['step']}, prompt {s['prompt']!r}")
            for choice, nll in sorted(s["scores"].items(), key=lambda kv: kv[1]):
                print(f"{nll:10.4f}  {choice!r}{'  <- best' if choice == s['best'] else ''}")
        else:
            print(f"--- {s['objective']} sample, step {s['step']} ({s['weights']}), prompt {s['prompt']!r}")
            print(s["prompt"] + s["text"])
    return 0


if __name__ == "__main__":
    from muloco.utils.command_line import run_main

    run_main(main)
