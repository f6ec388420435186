"""muloco's model as an lm-evaluation-harness ``LM``.

lm-eval asks three things of a model; each is answered with muloco's own scorer and sampler
(:mod:`muloco.objectives.likelihood`, :mod:`muloco.objectives.sampling`):

- ``loglikelihood(context, continuation)``: an autoregressive model's exact log p by the chain
  rule, ``--batch-size`` requests per forward; a masked-diffusion model's is LLaDA's Monte Carlo
  bound (−NELBO, ``mc_samples`` rows, a lower bound on log p). Every request draws the same
  random numbers (one seed), so the choices of a question are compared on equal noise. lm-eval's
  ``is_greedy`` is, for a causal model, whether every continuation token is the argmax; for a
  diffusion model, whether it is with the whole continuation masked at once.
- ``loglikelihood_rolling(text)`` (perplexity tasks): the sum over windows of the model's length,
  each conditioned on the end of the previous one (lm-eval's rolling windows) for a causal
  model; for a diffusion model the bound of each window given BOS.
- ``generate_until``: greedy or sampled tokens, cut at the task's stop strings; a diffusion
  model fills ``max_gen_toks`` masks by LLaDA's schedule in ``block_length`` blocks.

Text becomes ids as lm-eval's Hugging Face model does (context and continuation encoded
together, then split), with BOS in front as muloco trains. A context longer than the model's
training length is cut on the left.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from muloco.evaluate.source import EvaluationError, Source
from muloco.objectives.likelihood import diffusion_nll
from muloco.objectives.sampling import DiffusionSampling, sample_autoregressive, sample_model, sampling_for, until_eos

DEFAULT_GEN_TOKENS = 256


class MulocoLM(TemplateLM):
    def __init__(
        self,
        source: Source,
        *,
        batch_size: int = 8,
        mc_samples: int = 128,
        seed: int = 0,
        block_length: int | None = None,
    ):
        super().__init__()
        self.source, self.batch_size, self.mc_samples, self.seed = source, batch_size, mc_samples, seed
        self.block_length = block_length
        self.model = source.model
        self.device_ = next(source.model.parameters()).device

    # -- tokenization (TemplateLM calls these) --
    @property
    def eot_token_id(self) -> int:
        return self.source.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.source.tokenizer.bos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.source.tokenizer.encode(string, add_bos=add_special_tokens is not False)

    def tok_decode(self, ids: list[int]) -> str:
        return self.source.tokenizer.decode(ids)

    # -- log-likelihoods --
    def _fit(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """Context cut on the left so that both fit the model's length (the causal model reads one
        token fewer than it is given)."""
        room = self.source.max_length + (1 if self.source.causal else 0)
        if len(continuation) >= room:
            raise EvaluationError(
                f"a continuation of {len(continuation)} tokens does not fit the model's "
                f"{self.source.max_length}-token length with any context"
            )
        return context[max(0, len(context) - (room - len(continuation))) :], continuation

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = [self._fit(context, continuation) for _, context, continuation in requests]
        if not self.source.causal:
            return [self._diffusion_loglikelihood(c, t) for c, t in pairs]
        out: list[tuple[float, bool]] = []
        for first in range(0, len(pairs), self.batch_size):
            out += self._causal_batch(pairs[first : first + self.batch_size])
        return out

    @torch.no_grad()
    def _causal_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """One forward over right-padded rows (causal attention never looks at the padding)."""
        rows = [(c + t)[:-1] for c, t in pairs]
        width = max(len(r) for r in rows)
        x = torch.zeros(len(rows), width, dtype=torch.long, device=self.device_)
        for i, r in enumerate(rows):
            x[i, : len(r)] = torch.tensor(r, device=self.device_)
        logits = self.model(x).float()
        out = []
        for i, (context, target) in enumerate(pairs):
            at = slice(len(context) - 1, len(context) - 1 + len(target))
            scores = logits[i, at]
            want = torch.tensor(target, device=self.device_)
            logp = -F.cross_entropy(scores, want, reduction="sum").item()
            out.append((logp, bool((scores.argmax(-1) == want).all())))
        return out

    def _generator(self) -> torch.Generator:
        return torch.Generator(device=self.device_).manual_seed(self.seed)

    @torch.no_grad()
    def _diffusion_loglikelihood(self, context: list[int], target: list[int]) -> tuple[float, bool]:
        mask_id = self.source.mask_id
        nll = diffusion_nll(
            self.model,
            context,
            target,
            mask_id,
            samples=self.mc_samples,
            batch=min(self.mc_samples, max(1, self.batch_size)),
            generator=self._generator(),
            device=self.device_,
            readout=self.source.readout,
        )
        x = torch.tensor([context + [mask_id] * len(target)], device=self.device_)
        first = len(context) - 1 if self.source.readout.shift else len(context)  # the outputs that predict the target
        logits = self.model(x).float()[0, first : first + len(target)]
        logits[:, mask_id] = -torch.inf
        greedy = bool((logits.argmax(-1) == torch.tensor(target, device=self.device_)).all())
        return -nll, greedy

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (text,) in (r.args for r in requests):
            ids = self.tok_encode(text, add_special_tokens=False)
            if self.source.causal:
                windows = [
                    make_disjoint_window(w)
                    for w in get_rolling_token_windows(ids, self.prefix_token_id, self.source.max_length, 1)
                ]
                out.append(sum(logp for logp, _ in self._loglikelihood_tokens([(None, c, t) for c, t in windows])))
            else:
                span = self.source.max_length - 1
                out.append(
                    sum(
                        self._diffusion_loglikelihood([self.prefix_token_id], ids[i : i + span])[0]
                        for i in range(0, len(ids), span)
                    )
                )
        return out

    # -- generation --
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return [self._generate(context, kwargs or {}) for context, kwargs in (r.args for r in requests)]

    def _generate(self, context: str, kwargs: dict) -> str:
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        length = int(kwargs.get("max_gen_toks", DEFAULT_GEN_TOKENS))
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
        ids = self.tok_encode(context)
        room = self.source.max_length - length
        if room < 1:
            raise EvaluationError(
                f"max_gen_toks {length} leaves no room for a context in the model's "
                f"{self.source.max_length}-token length"
            )
        ids = ids[-room:]
        tokenizer = self.source.tokenizer
        if self.source.causal:
            tokens = sample_autoregressive(
                self.model, ids, tokenizer.eos_id, length, temperature, self._generator(), self.device_
            )
        else:
            readout = self.source.readout
            how = sampling_for(
                DiffusionSampling(length=length, steps=length, temperature=temperature),
                readout,
                self.block_length,
                None,
            )
            if not readout.block_size and length % how.block_length:
                raise EvaluationError(
                    f"block length {how.block_length} does not divide the task's max_gen_toks "
                    f"{length}; choose a divisor of it (--block-length)"
                )
            tokens = sample_model(
                self.model, [ids], self.source.mask_id, how, self._generator(), self.device_, readout
            )[0]
        text = tokenizer.decode(until_eos(tokens, tokenizer.eos_id))
        for stop in until:
            text = text.split(stop)[0] if stop else text
        return text
