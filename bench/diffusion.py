"""Masked-diffusion objective against next-token prediction, and the validator's ELBO variance.

    .venv/bin/python bench/diffusion.py [--flavor F] [--seq-len L] [--batch B] [--steps 12]
        [--repeats 5] [--threads 1] [--checkpoint RUN_FOLDER] [--skip-throughput|attention|variance] [--json PATH]
        [--smoke]

1. Throughput. One model, one batch shape, one optimizer (AdamW), forward + backward +
   step through each objective's ``prepare``/``loss`` exactly as the trainer calls them:
   ``ar`` (causal, full head), ``ar+docmask``, ``mdlm`` (bidirectional, document mask,
   head only at masked positions: the default), ``mdlm full-head`` and ``mdlm no-docmask``.
   Variants are timed round-robin (``--repeats`` rounds of ``--steps`` steps after a
   warm-up), so machine noise spreads over all of them; the medians of tokens/s and their
   ratio to ``ar`` (target: mdlm ≥ 0.97) are printed, with the spread of the ratios.
   bf16 autocast on CUDA, float32 on CPU. On CUDA three more rows compare the GPU paths
   with what they replace: ``mdlm flex`` and ``ar+docmask flex`` (the document mask as
   FlexAttention's block mask instead of the default dense boolean to SDPA: the figure that
   decides whether ``mask_kernel`` should default to flex on CUDA) and ``mdlm exact-gather`` (``pred[masked]``, a
   device sync per step, instead of the
   fixed-capacity gather). FlexAttention trains only on CUDA, so on CPU these rows are left
   out and both kernels are the SDPA path. ``--json PATH`` appends the medians after every
   round (a bench cut short by its time box keeps the rounds it finished).
2. Attention kernels, forward only: the ``mdlm`` model's forward passes with the document mask
   through SDPA's dense boolean and through FlexAttention's block mask, round-robin (the one
   comparison of the two that runs on a CPU: eager flex there, compiled on CUDA).
3. ELBO variance. The validator's estimate of the negative ELBO per token on fixed
   validation batches, repeated with ``--variance-repeats`` different seeds at 1, 8 and 32
   noise levels per batch; prints mean, standard deviation across seeds and the cost in
   forward passes. With ``--checkpoint`` (a run folder) the model is a trained one.
``--smoke`` (CI): the three parts on ``llama3-w64-d2-h2``, seq 64, batch 2, one step per round,
one round, two seeds on one batch (an untrained model: ``--checkpoint`` needs a run).
Nothing here asserts on timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from muloco import compat  # noqa: E402

compat.apply()

import torch  # noqa: E402
from torchtitan.components.loss import IGNORE_INDEX  # noqa: E402

from muloco.data.loader import PackedTextDataLoader  # noqa: E402
from muloco.data.tokenizer import MulocoTokenizer  # noqa: E402
from muloco.models import ModelConfig, init_model  # noqa: E402
from muloco.objectives import Autoregressive, MaskedDiffusion, NoiseKey, SpecialTokens  # noqa: E402
from muloco.objectives.gather import MaskedPositions  # noqa: E402

TARGET_RATIO = 0.97
VARIANTS = {
    "ar": Autoregressive.Config(),
    "ar+docmask": Autoregressive.Config(document_mask=True),
    "mdlm": MaskedDiffusion.Config(),
    "mdlm full-head": MaskedDiffusion.Config(masked_only_head=False),
    "mdlm no-docmask": MaskedDiffusion.Config(document_mask=False),
}
CUDA_VARIANTS = {
    "mdlm flex": MaskedDiffusion.Config(mask_kernel="flex"),
    "ar+docmask flex": Autoregressive.Config(document_mask=True, mask_kernel="flex"),
    "mdlm exact-gather": MaskedDiffusion.Config(),
}
EXACT_GATHER = {"mdlm exact-gather"}
"""Variants whose masked positions are gathered as ``pred[masked]`` (the path before the fixed capacity)."""


def _batches(tokenizer, next_token: bool, seq_len: int, batch: int, n: int, split="train"):
    cfg = PackedTextDataLoader.Config(next_token=next_token, split=split)
    loader = cfg.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=batch)
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _model(flavor: str, vocab: int, causal: bool, device, seed=0):
    torch.manual_seed(seed)
    return init_model(ModelConfig(flavor=flavor), vocab, causal, device)


class Variant:
    def __init__(self, name, cfg, tokenizer, args, device, state):
        tokens = SpecialTokens(bos=tokenizer.bos_id, eos=tokenizer.eos_id, mask=tokenizer.mask_id)
        self.name, self.device = name, device
        self.objective = cfg.build(tokens=tokens, rows_per_step=args.batch)
        self.model = _model(args.flavor, tokenizer.get_vocab_size(), self.objective.causal, device)
        self.model.load_state_dict(state)
        self.model.train()
        if self.objective.skip_lm_head:
            self.model._skip_lm_head = True
            self.objective.lm_head = self.model.lm_head
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.data = [
            (d["input"].to(device), lab.to(device))
            for d, lab in _batches(tokenizer, self.objective.next_token, args.seq_len, args.batch, 4)
        ]
        self.step = 0

    def run(self, steps: int) -> float:
        """Seconds for ``steps`` training steps."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            self.step += 1
            inputs, labels = self.data[self.step % len(self.data)]
            batch = self.objective.prepare(inputs, labels, NoiseKey(0, self.step, 0, 0, 1))
            if self.name in EXACT_GATHER:
                batch.extra["positions"] = MaskedPositions.exact(batch.extra["masked"])
            gvt = (labels != IGNORE_INDEX).sum()
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                pred = self.model(batch.inputs, **batch.model_kwargs)
                loss = self.objective.loss(pred, batch, gvt)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start


def throughput(args, tokenizer, device) -> None:
    state = _model(args.flavor, tokenizer.get_vocab_size(), True, device).state_dict()
    chosen = {**VARIANTS, **(CUDA_VARIANTS if device.type == "cuda" else {})}
    variants = [Variant(name, cfg, tokenizer, args, device, state) for name, cfg in chosen.items()]
    n = sum(p.numel() for p in variants[0].model.parameters())
    print(
        f"throughput: {args.flavor} ({n / 1e6:.2f}M parameters), seq {args.seq_len} x batch {args.batch}, "
        f"{device}, {torch.get_num_threads()} thread(s), {args.steps} steps x {args.repeats} rounds",
        flush=True,
    )
    if device.type != "cuda":
        print(
            "(no CUDA: document masks take the SDPA path and masked positions are gathered exactly; "
            "the flex and fixed-capacity rows run on CUDA only)"
        )
    for v in variants:
        v.run(2)  # warm-up (compiles FlexAttention on CUDA)
    rates = {v.name: [] for v in variants}
    for done in range(1, args.repeats + 1):
        for v in variants:
            rates[v.name].append(args.batch * args.seq_len * args.steps / v.run(args.steps))
        if args.json:
            _write_json(args, device, n, rates, done)
    base = rates["ar"]
    print(f"{'objective':<22}{'tok/s (median)':>16}{'ratio to ar':>14}{'ratio spread':>16}")
    for name, r in rates.items():
        ratios = [a / b for a, b in zip(r, base)]
        print(
            f"{name:<22}{statistics.median(r):>16,.0f}{statistics.median(ratios):>14.3f}"
            f"{min(ratios):>8.3f}–{max(ratios):.3f}"
        )
    verdict = statistics.median([a / b for a, b in zip(rates["mdlm"], base)])
    print(
        f"mdlm (masked-only head, document mask) / ar = {verdict:.3f}: target >= {TARGET_RATIO} "
        f"{'met' if verdict >= TARGET_RATIO else 'MISSED'}"
    )
    for new, old in (("mdlm flex", "mdlm"), ("ar+docmask flex", "ar+docmask"), ("mdlm", "mdlm exact-gather")):
        if new in rates and old in rates:  # the GPU rows run on CUDA only
            ratio = statistics.median([a / b for a, b in zip(rates[new], rates[old])])
            print(f"{new} / {old} = {ratio:.3f} (the GPU path against the one it would replace)")


def _write_json(args, device, params, rates, rounds) -> None:
    with open(args.json, "a") as f:
        f.write(
            json.dumps(
                {
                    "table": "diffusion",
                    "device": str(device),
                    "flavor": args.flavor,
                    "parameters": params,
                    "seq_len": args.seq_len,
                    "batch": args.batch,
                    "rounds": rounds,
                    "tokens_per_s": {k: statistics.median(v) for k, v in rates.items()},
                }
            )
            + "\n"
        )


def attention_forward(args, tokenizer, device) -> None:
    """Forward passes (evaluation, sampling-free scoring) of the mdlm model with the document mask
    as SDPA's dense boolean and as FlexAttention's block mask: the one comparison of the two
    kernels that runs on a CPU too (FlexAttention has no backward there; eager, unfused)."""
    model = _model(args.flavor, tokenizer.get_vocab_size(), False, device).eval()
    tokens = SpecialTokens(bos=tokenizer.bos_id, eos=tokenizer.eos_id, mask=tokenizer.mask_id)
    kernels = {k: MaskedDiffusion.Config(mask_kernel=k).build(tokens=tokens) for k in ("sdpa", "flex")}
    data = [
        kernels["sdpa"].prepare(d["input"].to(device), lab.to(device), NoiseKey(0, i, 0, 0, 1)).inputs
        for i, (d, lab) in enumerate(_batches(tokenizer, False, args.seq_len, args.batch, 4))
    ]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    @torch.no_grad()
    def seconds(kernel: str, n: int) -> float:
        sync()
        start = time.perf_counter()
        for i in range(n):
            x = data[i % len(data)]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                model(x, **kernels[kernel].attention_kwargs(x))
        sync()
        return time.perf_counter() - start

    for kernel in kernels:
        seconds(kernel, 2)  # warm-up (compiles FlexAttention on CUDA)
    rates = {k: [] for k in kernels}
    for _ in range(args.repeats):
        for k in kernels:
            rates[k].append(args.batch * args.seq_len * args.steps / seconds(k, args.steps))
    ratios = [a / b for a, b in zip(rates["flex"], rates["sdpa"])]
    print(
        f"\nattention kernels, forward only (mask built per batch, as validation does): {args.flavor}, "
        f"seq {args.seq_len} x batch {args.batch}, {device}{'' if device.type == 'cuda' else ', flex eager'}"
    )
    print(f"{'mask kernel':<14}{'tok/s (median)':>16}")
    for k, r in rates.items():
        print(f"{k:<14}{statistics.median(r):>16,.0f}")
    print(f"flex / sdpa = {statistics.median(ratios):.3f} (spread {min(ratios):.3f}–{max(ratios):.3f})")
    if args.json:
        with open(args.json, "a") as f:
            f.write(
                json.dumps(
                    {
                        "table": "attention",
                        "device": str(device),
                        "flavor": args.flavor,
                        "seq_len": args.seq_len,
                        "batch": args.batch,
                        "eager": device.type != "cuda",
                        "tokens_per_s": {k: statistics.median(v) for k, v in rates.items()},
                    }
                )
                + "\n"
            )


def elbo_variance(args, tokenizer, device) -> None:
    if args.checkpoint:
        from muloco.trained_model import load_config, load_model, locate

        run, step = locate(args.checkpoint, 0, None)
        config = load_config(run)
        model, _, _, step, _ = load_model(run, config, step, device)
        seq_len, batch, what = config.training.seq_len, config.training.local_batch_size, f"{run} step {step}"
    else:
        model = _model(args.flavor, tokenizer.get_vocab_size(), False, device)
        seq_len, batch, what = args.seq_len, args.batch, f"untrained {args.flavor}"
    model.eval()
    tokens = SpecialTokens(bos=tokenizer.bos_id, eos=tokenizer.eos_id, mask=tokenizer.mask_id)
    data = _batches(tokenizer, False, seq_len, batch, args.variance_batches, split="validation")
    print(
        f"\nELBO variance: {what}, {args.variance_batches} validation batches of {batch} x {seq_len}, "
        f"{args.variance_repeats} seeds"
    )
    print(f"{'levels/batch':>12}{'NELBO mean':>12}{'std (seeds)':>13}{'rel std':>9}{'forwards':>10}")
    for samples in (1, 8, 32):
        values = []
        for seed in range(args.variance_repeats):
            obj = MaskedDiffusion.Config(eval_samples=samples, seed=seed, masked_only_head=False).build(tokens=tokens)
            sums = torch.zeros(4, dtype=torch.float64, device=device)
            for i, (d, labels) in enumerate(data):
                sums += obj.elbo_terms(model, d["input"].to(device), labels.to(device), batch_index=i)
            values.append((sums[0] / sums[1]).item())
        mean, std = statistics.mean(values), statistics.stdev(values)
        print(f"{samples:>12}{mean:>12.4f}{std:>13.4f}{std / mean:>9.4f}{samples * len(data):>10}")


SMOKE = {
    "flavor": "llama3-w64-d2-h2",
    "seq_len": 64,
    "batch": 2,
    "steps": 1,
    "repeats": 1,
    "variance_batches": 1,
    "variance_repeats": 2,
    "checkpoint": None,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="llama3-w128-d4-h2")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (0: torch's default)")
    p.add_argument("--checkpoint", default=None, help="a mdlm run folder for the ELBO-variance part")
    p.add_argument("--variance-batches", type=int, default=4)
    p.add_argument("--variance-repeats", type=int, default=8)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-variance", action="store_true")
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument(
        "--json",
        default=None,
        help="append the throughput medians as a JSON line after every round, and the attention figures",
    )
    p.add_argument("--smoke", action="store_true", help="both parts at a tiny size: checks the bench runs (CI)")
    args = p.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = MulocoTokenizer()
    if not args.skip_throughput:
        throughput(args, tokenizer, device)
    if not args.skip_attention:
        attention_forward(args, tokenizer, device)
    if not args.skip_variance:
        elbo_variance(args, tokenizer, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
