"""The objectives on their own: masked-diffusion loss against float64 references, the ELBO
estimator against the exact sum, noise-level stratification, masks, document masks."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from muloco import compat

compat.apply()

from torchtitan.components.loss import IGNORE_INDEX  # noqa: E402

from muloco.config.checks import check_config  # noqa: E402
from muloco.config.cli import parse_args  # noqa: E402
from muloco.config.loader import ConfigError  # noqa: E402
from muloco.objectives import Autoregressive, MaskedDiffusion, NoiseKey, SpecialTokens  # noqa: E402
from muloco.objectives.documents import document_ids  # noqa: E402
from muloco.objectives.noise import elbo_weight, mask_probability  # noqa: E402

V, BOS, EOS, MASK = 32, 29, 30, 31
TOKENS = SpecialTokens(bos=BOS, eos=EOS, mask=MASK)


def _key(step=1, micro=0, rank=0, world=1):
    return NoiseKey(replica=0, step=step, micro=micro, rank=rank, world=world)


def _rows(b=4, n=24, seed=0):
    """Packed rows as the loader makes them for masked diffusion: documents [bos … eos]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 29, (b, n), generator=g)
    x[:, 0], x[:, 9], x[:, 10], x[:, 17], x[:, 18] = BOS, EOS, BOS, EOS, BOS
    return x, x.clone()  # pre-training: every token a target, BOS and EOS included


def _objective(**kw) -> MaskedDiffusion:
    kw.setdefault("truncate_probability", 0.0)
    return MaskedDiffusion.Config(**kw).build(tokens=TOKENS, rows_per_step=kw.pop("rows", 4))


def _tiny_model(causal=False, seed=0):
    return tiny_model(causal, V, seed).double()


def _reference_loss(logits, batch, cfg, rows_global, gvt, labels):
    """Σ_masked w·CE / normaliser in float64, written out plainly (CART with a dense L×L matrix)."""
    masked, t, x0 = batch.extra["masked"], batch.extra["t"].double(), batch.labels
    logp = logits.double().clone()
    logp[..., MASK] = -math.inf
    ce = -torch.log_softmax(logp, -1).gather(-1, x0.unsqueeze(-1)).squeeze(-1)
    total = torch.zeros((), dtype=torch.float64)
    for b in range(x0.shape[0]):
        L = x0.shape[1]
        for i in range(L):
            if not masked[b, i]:
                continue
            if cfg.weight == "elbo":
                w = 1.0 / t[b] if cfg.schedule == "linear" else 0.5 * math.pi * math.tan(0.5 * math.pi * (1 - t[b]))
            elif cfg.weight == "uniform":
                w = 1.0
            else:
                w = sum(
                    0.5 * cfg.cart_p * (1 - cfg.cart_p) ** (abs(i - j) - 1)
                    for j in range(L)
                    if j != i and not masked[b, j]
                )
            if cfg.normaliser == "sequence":
                w = w / int((labels[b] != IGNORE_INDEX).sum())
            total = total + w * ce[b, i]
    if cfg.normaliser == "tokens":
        return total / gvt
    return total / rows_global


@pytest.mark.parametrize(
    "weight,normaliser,schedule",
    [
        ("elbo", "tokens", "linear"),
        ("elbo", "sequence", "cosine"),
        ("uniform", "batch", "linear"),
        ("cart", "tokens", "linear"),
    ],
)
def test_loss_equals_a_float64_reference_on_fixed_masks_and_levels(weight, normaliser, schedule):
    torch.manual_seed(0)
    x, labels = _rows()
    obj = _objective(weight=weight, normaliser=normaliser, schedule=schedule, masked_only_head=False)
    batch = obj.prepare(x, labels, _key())
    assert batch.extra["masked"].any()
    logits = torch.randn(*x.shape, V, dtype=torch.float64)
    gvt = torch.tensor(float((labels != IGNORE_INDEX).sum()))
    got = obj.loss(logits, batch, gvt)
    want = _reference_loss(logits, batch, obj.config, 4, gvt, labels)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def _loss_and_grads(obj, model, x, labels, gvt) -> tuple[float, list[torch.Tensor]]:
    """One training step's loss of ``obj`` on ``model`` and every parameter's gradient."""
    obj.lm_head = model.lm_head
    batch = obj.prepare(x, labels, _key())
    model.zero_grad()
    loss = obj.loss(model(batch.inputs), batch, gvt)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def test_masked_only_head_gives_the_loss_and_gradients_of_the_full_head():
    x, labels = _rows()
    model = _tiny_model().float().train()
    gvt = torch.tensor(float((labels != IGNORE_INDEX).sum()))
    results = []
    for masked_only in (False, True):
        model._skip_lm_head = masked_only
        results.append(_loss_and_grads(_objective(masked_only_head=masked_only), model, x, labels, gvt))
    (full, g_full), (head, g_head) = results
    assert head == pytest.approx(full, rel=1e-6)
    for a, b in zip(g_full, g_head):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("masked_only_head", [True, False])
def test_compiled_scoring_gives_the_eager_loss_and_gradients(masked_only_head):
    """``--compile.enable`` compiles the masked-diffusion scoring (upcast, −∞ mask logit,
    cross-entropy, weights) as torchtitan compiles its loss; the loss and every gradient stay
    those of the eager path. Inductor on the CPU, as a compiled run here builds it."""
    from torchtitan.config import CompileConfig

    from muloco.objectives.masked_loss import masked_cross_entropy

    x, labels = _rows()
    model = _tiny_model().float().train()
    model._skip_lm_head = masked_only_head
    gvt = torch.tensor(float((labels != IGNORE_INDEX).sum()))
    results = []
    for compiled in (False, True):
        obj = _objective(masked_only_head=masked_only_head)
        if compiled:
            obj.use_loss(None, CompileConfig(enable=True))
        assert (obj.scoring.fn is masked_cross_entropy) is not compiled
        results.append(_loss_and_grads(obj, model, x, labels, gvt))
    (eager, g_eager), (comp, g_comp) = results
    assert comp == pytest.approx(eager, rel=1e-6)
    for a, b in zip(g_eager, g_comp):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert not any(torch.isnan(g).any() for g in g_comp)


def test_the_mask_token_is_never_predicted():
    x, labels = _rows()
    obj = _objective(masked_only_head=False)
    batch = obj.prepare(x, labels, _key())
    logits = torch.zeros(*x.shape, V)
    logits[..., MASK] = 100.0  # the model would say "mask" everywhere
    picked = obj.logits_at(logits, batch.extra["masked"])
    assert torch.isneginf(picked[:, MASK]).all() and torch.isfinite(obj.loss(logits, batch))


@pytest.mark.parametrize("eps", [1e-3, 0.2])
def test_validation_nelbo_is_the_exact_bound_over_every_mask_subset_whatever_eps(eps):
    """NELBO = Σ_l (1/l)·E_{|S|=l}[Σ_{i∈S} CE_i(x_S)] (the whole of t ∈ [0, 1)): every subset of a
    6-token row, against the validation estimator. It is unbiased for any ε: the training floor
    plays no part (a (1 − ε)·∫_ε^1 estimate would sit ~ε·L·CE low: 20% at ε = 0.2)."""
    model = _tiny_model()
    L = 6
    x = torch.randint(0, 29, (1, L), generator=torch.Generator().manual_seed(3))
    labels = x.clone()
    obj = _objective(eps=eps, masked_only_head=False, document_mask=False, eval_samples=8)
    exact = 0.0
    for n in range(1, L + 1):
        terms = []
        for subset in itertools.combinations(range(L), n):
            where = torch.zeros(1, L, dtype=torch.bool)
            where[0, list(subset)] = True
            with torch.no_grad():
                logits = obj.logits_at(model(x.masked_fill(where, MASK)), where)
            terms.append(F.cross_entropy(logits, x[where], reduction="sum").item())
        exact += sum(terms) / len(terms) / n
    rows = 256  # the row repeated: every row draws its own levels, so one call is many samples
    estimates = []
    for batch_index in range(8):
        nelbo, tokens, _, _ = obj.elbo_terms(
            model, x.repeat(rows, 1), labels.repeat(rows, 1), batch_index=batch_index
        ).tolist()
        assert tokens == L * rows
        estimates.append(nelbo / rows)
    mean = sum(estimates) / len(estimates)
    se = (sum((e - mean) ** 2 for e in estimates) / (len(estimates) - 1) / len(estimates)) ** 0.5
    assert abs(mean - exact) < 4 * se + 1e-3 * exact, (mean, se, exact)
    assert se < 0.01 * exact  # the test can tell a bias of a few percent


def test_noise_levels_cover_every_stratum_of_the_step_across_two_ranks():
    eps, rows, world = 1e-3, 4, 2
    obj = _objective(eps=eps)
    x, labels = _rows(b=rows)
    levels = torch.cat([obj.prepare(x, labels, _key(step=7, rank=r, world=world)).extra["t"] for r in range(world)])
    u = ((levels - eps) / (1 - eps)).double()
    strata = torch.floor(u * rows * world).long().sort().values
    assert strata.tolist() == list(range(rows * world))  # one level in each [j/n, (j+1)/n)
    other_step = torch.cat([obj.prepare(x, labels, _key(step=8, rank=r, world=world)).extra["t"] for r in range(world)])
    assert not torch.equal(levels, other_step)


def test_masks_touch_every_target_bos_and_eos_included_never_an_ignored_token_and_are_reproducible():
    x, labels = _rows()
    labels[:, 1:4] = IGNORE_INDEX  # e.g. an SFT prompt
    labels[1, 0] = labels[2, 9] = IGNORE_INDEX
    obj = _objective(eps=0.9)  # t >= 0.9: nearly everything maskable is masked
    for step in range(5):
        batch = obj.prepare(x, labels, _key(step=step))
        masked = batch.extra["masked"]
        assert not masked[labels == IGNORE_INDEX].any()
        assert (batch.inputs[~masked] == x[~masked]).all() and (batch.inputs[masked] == MASK).all()
        assert masked.float().mean() > 0.5
        assert masked[x == EOS].any() and masked[(x == BOS) & (labels != IGNORE_INDEX)].any()
        again = obj.prepare(x, labels, _key(step=step))
        assert torch.equal(again.inputs, batch.inputs)


def test_complementary_masks_split_the_maskable_tokens_between_two_copies():
    x, labels = _rows()
    obj = _objective(complementary_masks=True, eps=0.3)
    batch = obj.prepare(x, labels, _key())
    m = batch.extra["masked"]
    assert m.shape[0] == 2 * x.shape[0]
    a, b = m[: x.shape[0]], m[x.shape[0] :]
    assert not (a & b).any() and torch.equal(a | b, labels != IGNORE_INDEX)


def test_truncation_cuts_every_rank_to_the_same_length_and_prepare_never_cuts():
    x, labels = _rows(n=64)
    obj = _objective(truncate_probability=1.0)
    cuts = [obj.truncate(x, labels, _key(step=3, rank=r, world=2)) for r in range(2)]
    assert cuts[0][0].shape == cuts[1][0].shape and cuts[0][0].shape[1] < 64
    assert torch.equal(cuts[0][0], x[:, : cuts[0][0].shape[1]]) and torch.equal(
        cuts[0][1], labels[:, : cuts[0][0].shape[1]]
    )
    assert obj.prepare(x, labels, _key(step=3)).inputs.shape == x.shape
    never = _objective(truncate_probability=0.0)
    assert all(never.truncate(x, labels, _key(step=s))[0] is x for s in range(20))


def test_a_masked_bos_joins_two_documents_so_attention_never_reveals_a_masked_boundary():
    """The document mask follows the noised row: a visible BOS starts a document, a masked one
    does not (else a masked EOS would be "the last position I can see" and a model would never
    learn to stop before the end of a sampling canvas)."""
    obj = _objective()
    x, _ = _rows(b=1)
    visible = obj.attention_kwargs(x)["attention_masks"][0, 0]
    assert not visible[5, 12]  # the first and the second document apart
    xt = x.clone()
    xt[0, 9], xt[0, 10] = MASK, MASK  # the first EOS and the second BOS masked
    joined = obj.attention_kwargs(xt)["attention_masks"][0, 0]
    assert joined[5, 12] and joined[12, 5] and not joined[5, 20]
    batch = obj.prepare(x, x.clone(), _key())
    torch.testing.assert_close(
        batch.model_kwargs["attention_masks"], obj.attention_kwargs(batch.inputs)["attention_masks"]
    )


@pytest.mark.parametrize("causal", [False, True])
def test_a_token_sees_nothing_of_the_other_documents_in_its_row(causal):
    model = _tiny_model(causal=causal)
    obj = (Autoregressive.Config(document_mask=True) if causal else MaskedDiffusion.Config()).build(tokens=TOKENS)
    x, _ = _rows(b=1)
    other = x.clone()
    other[0, 11:17] = (other[0, 11:17] + 5) % 29  # change the second document only
    ids = document_ids(x, BOS)[0]
    first = ids == ids[1]
    with torch.no_grad():
        a = model(x, **obj.attention_kwargs(x))
        b = model(other, **obj.attention_kwargs(other))
        c, d = model(x), model(other)
    torch.testing.assert_close(a[0, first], b[0, first], rtol=0, atol=1e-12)
    if not causal:  # without the mask the first document reads the second
        assert (c[0, first] - d[0, first]).abs().max() > 1e-4


@pytest.mark.parametrize(
    "args,message",
    [
        (["--objective.eps", "1.5"], "objective.eps is 1.5; it must be in (0, 1)"),
        (["--objective.eps", "0"], "objective.eps is 0.0; it must be in (0, 1)"),
        (["--objective.schedule", "sqrt"], "objective.schedule must be one of linear, cosine; got 'sqrt'"),
        (["--objective.weight", "focal"], "objective.weight must be one of elbo, uniform, cart; got 'focal'"),
    ],
)
def test_bad_objective_settings_are_one_clear_error(args, message):
    _, config = parse_args(["--config", "ddp/adamw", "--objective", "mdlm", *args])
    with pytest.raises(ConfigError) as err:
        check_config(config)
    assert message in str(err.value)


def test_a_tokenizer_without_a_mask_token_is_a_clear_error():
    with pytest.raises(ValueError, match="no mask token"):
        MaskedDiffusion.Config().build(tokens=SpecialTokens(bos=BOS, eos=EOS, mask=None))


def test_bidirectional_attention_only_comes_with_the_diffusion_objective():
    with pytest.raises(ConfigError, match="the attention direction follows the objective"):
        parse_args(["--config", "ddp/adamw", "--model.no-causal"])
    assert MaskedDiffusion.causal is False and Autoregressive.causal is True


def test_schedules_weights_are_minus_alpha_prime_over_one_minus_alpha():
    t = torch.linspace(0.01, 0.99, 50, dtype=torch.float64)
    for schedule in ("linear", "cosine"):
        p = mask_probability(t, schedule)
        dp = torch.autograd.functional.jacobian(lambda s: mask_probability(s, schedule), t).diagonal()
        torch.testing.assert_close(elbo_weight(t, schedule), dp / p)


def test_flops_count_the_head_only_where_it_runs():
    model_flops, head = 1e9, 1_000_000
    assert Autoregressive.Config().build(tokens=TOKENS).flops_per_token(model_flops, head) == model_flops
    mdlm = _objective()
    assert mdlm.expected_mask_fraction() == pytest.approx(0.5 + 0.5e-3, rel=1e-6)  # E[t], t = ε + (1-ε)u
    assert mdlm.flops_per_token(model_flops, head) == pytest.approx(model_flops - 6 * head * (1 - 0.5005))
    assert _objective(masked_only_head=False).flops_per_token(model_flops, head) == model_flops
    assert _objective(complementary_masks=True, masked_only_head=False).flops_per_token(model_flops, head) == 2e9


COMPILED_LOSS = """
import json, os, sys
from muloco import compat
compat.apply()
import torch
from torchtitan.components.loss import cross_entropy_loss
from muloco.config.cli import parse_args
from muloco.objectives import Prepared
from muloco.trainer import MulocoTrainer

dump, args = sys.argv[1], sys.argv[2:]
_, config = parse_args(args + ["--dump_folder", dump])
trainer = MulocoTrainer(config)
obj = trainer.objective
x, labels = torch.randn(2, 8, 64), torch.randint(0, 64, (2, 8))
eager = torch.nn.functional.cross_entropy(x.flatten(0, 1), labels.flatten(), reduction="sum") / 16
print("RESULT " + json.dumps({"same": obj.loss_fn is trainer.loss_fn,
                              "compiled": obj.loss_fn.fn is not cross_entropy_loss,
                              "loss": obj.loss(x, Prepared(x, labels, {}), torch.tensor(16.0)).item(),
                              "eager": eager.item()}), flush=True)
os._exit(0)
"""


@pytest.mark.timeout(300)
def test_next_token_scoring_uses_the_trainers_loss_compiled_as_stock_torchtitan_compiles_it(tmp_path):
    """Stock torchtitan compiles its loss with the model; the ar objective scores with the trainer's
    loss (the same object), so a compiled run compiles it too, and it gives plain cross-entropy."""
    from conftest import TINY, run_gloo_ranks

    script = tmp_path / "compiled_loss.py"
    script.write_text(COMPILED_LOSS)
    args = [
        "--config",
        "ddp/adamw",
        *TINY,
        "--compile.enable",
        "--training.steps",
        "1",
        "--validator.no-enable",
        "--checkpoint.no-enable",
    ]
    ((code, out),) = run_gloo_ranks(script, 1, [str(tmp_path / "run"), *args], quiet_s=240)
    assert code == 0, out[-3000:]
    got = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
    assert got["same"] and got["compiled"], got
    assert got["loss"] == pytest.approx(got["eager"], rel=1e-5), got


RECORDED_STEP = """
import json, os, sys
from muloco import compat
compat.apply()
import torch
from muloco.config.cli import parse_args
from muloco.trainer import MulocoTrainer

dump, args = sys.argv[1], sys.argv[2:]
_, config = parse_args(args + ["--dump_folder", dump])
trainer = MulocoTrainer(config)
calls, recorded = [], trainer.fwd_bwd_fn  # torchtitan's CUDA-graph wrapper on CUDA, the body itself here
trainer.fwd_bwd_fn = lambda *a: calls.append(sorted(a[3]["loss"])) or recorded(*a)
model = trainer.model_parts[0]
tokens = torch.randint(0, 64, (2, 32))
gvt = torch.tensor(64.0)
steps = []
for route in ("recorded", "eager"):
    model.zero_grad()
    trainer._micro = (None, 0)  # the same micro-batch key, so the same noise
    if route == "recorded":
        loss = trainer.forward_backward_step(input_dict={"input": tokens}, labels=tokens, global_valid_tokens=gvt)
    else:  # the same step (same noise key) scored directly, as before the graph
        inputs, labels, extra = trainer.post_dataloading_process({"input": tokens}, tokens)
        loss = trainer._score(trainer.objective.prepare(inputs, labels, trainer._noise_key()), extra, gvt)
    steps.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
(a, ga), (b, gb) = steps
cut = tokens[:, :24]  # a cut step: other shapes than the recorded ones, so it runs eagerly
trainer.forward_backward_step(input_dict={"input": cut}, labels=cut, global_valid_tokens=gvt)
print("RESULT " + json.dumps({"calls": calls, "same_loss": a == b,
                              "same_grads": all(torch.equal(x, y) for x, y in zip(ga, gb)),
                              "loss": a}), flush=True)
os._exit(0)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("objective, loss_inputs", [("ar", []), ("mdlm", ["index", "weight"])])
def test_a_step_runs_through_the_recorded_body_with_the_objectives_draws_as_inputs(tmp_path, objective, loss_inputs):
    """A step goes through torchtitan's ``fwd_bwd_fn`` (a CUDA graph on CUDA), masked diffusion's
    with the gather's positions and the weights as tensors, drawn outside it: the same loss and
    gradients, bit for bit, as scoring the step directly; a cut step (other shapes) runs eagerly."""
    from conftest import TINY, run_gloo_ranks

    script = tmp_path / "recorded_step.py"
    script.write_text(RECORDED_STEP)
    args = [
        "--config",
        "ddp/adamw",
        "--objective",
        objective,
        *TINY,
        "--training.steps",
        "1",
        "--validator.no-enable",
        "--checkpoint.no-enable",
    ]
    ((code, out),) = run_gloo_ranks(script, 1, [str(tmp_path / "run"), *args], quiet_s=240)
    assert code == 0, out[-3000:]
    got = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
    assert got["calls"] == [loss_inputs], got  # once: the cut step did not go through it
    assert got["same_loss"] and got["same_grads"] and math.isfinite(got["loss"]), got
    from torchtitan.components.loss import cross_entropy_loss

    assert Autoregressive.Config().build(tokens=TOKENS).loss_fn.fn is cross_entropy_loss  # eager off the trainer


def test_the_torch_free_names_are_the_objectives_the_command_line_picks():
    """``objectives.NAMES`` (compare's choices, the default first) lists exactly the variants of
    ``ObjectiveConfig``; each objective states the facts export, validation and evaluate ask of it."""
    from muloco.config.variants import choices
    from muloco.objectives import NAMES, ObjectiveConfig, named_by_attention
    from muloco.trainer import MulocoTrainer

    assert tuple(choices(ObjectiveConfig)) == NAMES
    assert isinstance(MulocoTrainer.Config().objective, choices(ObjectiveConfig)[NAMES[0]])
    for name, config in choices(ObjectiveConfig).items():
        objective = config._owner
        assert named_by_attention(objective.causal) == name
        assert objective.elbo_validation == objective.mask_token == (not objective.causal)
        assert config().describe().startswith(objective.title)
