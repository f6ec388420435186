"""Masked diffusion end to end: a real training run (its ELBO falls), its summary, and sampling
from its checkpoint with ``python -m muloco.generate``; the samplers on their own."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from conftest import REPO, TINY, hand_bits_per_byte, read_metrics, run_gloo_ranks, run_train, run_watched, tiny_model
from in_process import run_in_process

from muloco import compat

compat.apply()

from muloco.objectives.sampling import (  # noqa: E402
    DiffusionSampling,
    sample_autoregressive,
    sample_diffusion,
    sample_diffusion_batch,
    transfer_counts,
)

BOS, EOS, MASK = 29, 30, 31


@pytest.fixture(scope="module")
def diffusion_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("mdlm") / "run"
    proc = run_train(
        [
            "--config",
            "ddp/adamw",
            "--objective",
            "mdlm",
            *TINY,
            "--training.steps",
            "40",
            "--validator.freq",
            "20",
            "--validator.steps",
            "4",
            "--validator.tuning_steps",
            "2",
            "--metrics.log_freq",
            "10",
            "--optimizer.lr",
            "0.01",
            "--dump_folder",
            str(dump),
        ]
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return dump, proc.stdout + proc.stderr


def test_a_diffusion_run_reports_a_falling_elbo_and_its_bound(diffusion_run):
    dump, log = diffusion_run
    validations = [r for r in read_metrics(dump) if "validation_nelbo" in r]
    assert [r["step"] for r in validations] == [1, 20, 40]
    first, last = validations[0]["validation_nelbo"], validations[-1]["validation_nelbo"]
    # nats per token, on held-out data (seen here: 7.78, 7.34, 7.19)
    assert last < validations[1]["validation_nelbo"] < first - 0.3, validations
    assert validations[-1]["validation_masked_accuracy"] > validations[0]["validation_masked_accuracy"]
    s = json.loads((dump / "summary.json").read_text())
    assert s["objective"] == "mdlm" and s["final_validation_nelbo"] == pytest.approx(last)
    assert s["final_validation_ppl_bound"] == pytest.approx(torch.tensor(last).exp().item(), rel=1e-6)
    assert "final validation NELBO" in log and "ppl bound" in log and "bidirectional attention" in log
    # bits per byte of the held-out text, against a hand count of the same batches' targets and bytes
    for r in validations:
        assert r["validation_bits_per_byte"] == pytest.approx(
            hand_bits_per_byte(r["validation_nelbo"], next_token=False, seq_len=64, batch=4, steps=4), rel=1e-9
        )
    assert s["final_validation_bits_per_byte"] == pytest.approx(validations[-1]["validation_bits_per_byte"])
    # the tuning batches (the 2 after the 4 reported ones; compare --tune): scored beside each
    # validation, on other text, without touching the reported figures checked above
    tuning = [r["tuning_loss"] for r in validations]
    assert all(0 < t < 20 for t in tuning) and tuning != [r["validation_nelbo"] for r in validations]
    assert s["final_tuning_loss"] == pytest.approx(tuning[-1])


def _generate(dump, *args, capfd=None):
    """``python -m muloco.generate --checkpoint DUMP --json ARGS``: a real process, or with
    ``capfd`` its ``main`` in this process (``in_process.py``: a refusal costs 0.1 s, not ~5 s of
    CPU importing torch and torchtitan)."""
    argv = ["--checkpoint", str(dump), "--json", *args]
    if capfd is None:
        return run_watched([sys.executable, "-m", "muloco.generate", *argv], cwd=REPO)
    from muloco.generate.__main__ import main
    from muloco.utils.command_line import run_main

    return run_in_process(lambda: run_main(main), capfd, argv0="muloco.generate", args=argv, cwd=REPO)


def test_generate_fills_every_mask_after_the_prompt_and_repeats_with_a_seed(diffusion_run):
    from muloco.data.tokenizer import MulocoTokenizer
    from muloco.generate.__main__ import generate, parse_args

    dump, _ = diffusion_run
    args = [
        "--prompt",
        "def f(",
        "--prompt",
        "import",
        "--length",
        "24",
        "--block-length",
        "8",
        "--steps",
        "12",
        "--temperature",
        "0.7",
        "--seed",
        "3",
    ]
    cli = _generate(dump, *args)  # the command line once; the repeats in this process
    assert cli.returncode == 0, cli.stderr[-3000:]
    samples = [json.loads(line) for line in cli.stdout.splitlines()]
    assert [s["prompt"] for s in samples] == ["def f(", "import"]
    assert generate(parse_args(["--checkpoint", str(dump), *args])) == samples
    mask_id = MulocoTokenizer().mask_id
    for s in samples:
        assert len(s["tokens"]) == 24 and mask_id not in s["tokens"] and s["step"] == 40
    other_seed = generate(parse_args(["--checkpoint", str(dump), *args[:-1], "4"]))
    assert [s["tokens"] for s in other_seed] != [s["tokens"] for s in samples]


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_generate_samples_a_batch_of_prompts_as_it_samples_each_alone(diffusion_run, cache):
    from muloco.generate.__main__ import generate, parse_args

    dump, _ = diffusion_run
    args = [
        "--checkpoint",
        str(dump),
        "--prompt",
        "x",
        "--prompt",
        "def main(argv):",
        "--length",
        "16",
        "--block-length",
        "8",
        "--threshold",
        "0.5",
        "--cache",
        cache,
    ]
    together = generate(parse_args([*args, "--batch-size", "2"]))
    alone = generate(parse_args(args))
    assert [s["tokens"] for s in together] == [s["tokens"] for s in alone]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--replica", "1"], "--replica 1: "),
        (["--threshold", "1.5"], "--threshold must be in (0, 1]"),
        (["--length", "0"], "--length 0: must be at least 1"),
        (["--temperature", "-1"], "--temperature -1.0: must be a finite number >= 0"),
        (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
        (["--score", " x", "--threshold", "0.9"], "--threshold: sampling options, and --score does not sample"),
    ],
)
def test_generate_refuses_an_option_out_of_range_or_one_this_run_does_not_take(diffusion_run, args, message, capfd):
    dump, _ = diffusion_run
    proc = _generate(dump, "--prompt", "x", *args, capfd=capfd)
    assert proc.returncode == 2 and proc.stderr.startswith("muloco generate: error: ") and message in proc.stderr, (
        proc.stderr
    )
    assert len(proc.stderr.strip().splitlines()) == 1 and not proc.stdout


def test_generate_refuses_diffusion_options_on_an_autoregressive_run(tmp_path, capfd):
    dump = tmp_path / "ar"
    proc = run_train(
        ["--config", "ddp/adamw", *TINY, "--training.steps", "2", "--validator.no-enable", "--dump_folder", str(dump)]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    bad = _generate(dump, "--prompt", "x", "--steps", "8", "--order", "margin", capfd=capfd)
    assert bad.returncode == 2 and "--steps, --order: only for masked-diffusion runs" in bad.stderr, bad.stderr
    good = _generate(dump, "--prompt", "x", "--length", "4", capfd=capfd)
    assert good.returncode == 0 and json.loads(good.stdout)["objective"] == "ar", good.stderr[-2000:]


def test_generate_names_a_folder_that_is_not_a_run(tmp_path, capfd):
    proc = _generate(tmp_path, "--prompt", "x", capfd=capfd)
    assert proc.returncode == 2 and proc.stderr.startswith("muloco generate: error: ") and "run.json" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def _model(causal: bool):
    return tiny_model(causal)


@pytest.mark.parametrize("order", ["confidence", "margin", "entropy", "random"])
def test_diffusion_sampler_keeps_the_prompt_leaves_no_mask_and_is_deterministic(order):
    model = _model(causal=False)
    prompt = [29, 3, 4, 5]
    how = DiffusionSampling(length=12, steps=6, block_length=4, temperature=1.0, order=order)
    runs = [
        sample_diffusion(model, prompt, MASK, how, torch.Generator().manual_seed(s), torch.device("cpu"))
        for s in (1, 1, 2)
    ]
    assert runs[0] == runs[1] and len(runs[0]) == 12 and MASK not in runs[0]
    greedy = DiffusionSampling(length=12, steps=12, block_length=12)
    assert MASK not in sample_diffusion(model, prompt, MASK, greedy, torch.Generator(), torch.device("cpu"))


def test_transfer_schedule_and_bad_sampling_settings():
    assert transfer_counts(10, 4) == [3, 3, 2, 2] and sum(transfer_counts(7, 7)) == 7
    with pytest.raises(ValueError, match="multiple of --block-length"):
        DiffusionSampling(length=10, block_length=4).check()
    with pytest.raises(ValueError, match="multiple of the number of blocks"):
        DiffusionSampling(length=8, steps=3, block_length=4).check()


def _bench_generate():
    """bench/generate.py as a module: its ``reference_generate`` is LLaDA's loop written plainly."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_generate", REPO / "bench" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "length,steps,block,temperature", [(12, 12, 12, 0.0), (12, 6, 4, 0.0), (16, 8, 8, 0.7), (12, 24, 6, 1.0)]
)
def test_the_default_sampler_is_llada_token_for_token_alone_and_in_a_batch(length, steps, block, temperature):
    """No threshold: the sampler's trajectories are the reference loop's (greedy and Gumbel draws
    from the same seed), for one prompt and for a batch of prompts of one length."""
    reference = _bench_generate().reference_generate
    model = _model(causal=False)
    prompts = torch.tensor([[29, 3, 4, 5], [29, 7, 7, 1], [29, 0, 2, 9]])
    how = DiffusionSampling(length=length, steps=steps, block_length=block, temperature=temperature)
    for rows in (prompts[:1], prompts):
        want = reference(model, rows, MASK, length, steps, block, temperature, torch.Generator().manual_seed(3))
        got = sample_diffusion_batch(
            model, rows.tolist(), MASK, how, torch.Generator().manual_seed(3), torch.device("cpu")
        )
        assert got == want.tolist()


class _Counted(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


def test_a_threshold_fills_every_sure_position_at_once_and_at_one_is_one_token_per_step():
    model = _Counted(_model(causal=False))
    prompt, cpu = [29, 3, 4, 5], torch.device("cpu")
    one_by_one = sample_diffusion(
        model, prompt, MASK, DiffusionSampling(length=12, steps=12, block_length=4), torch.Generator(), cpu
    )
    assert model.calls == 12
    model.calls = 0
    at_one = sample_diffusion(
        model,
        prompt,
        MASK,
        DiffusionSampling(length=12, steps=12, block_length=4, threshold=1.0),
        torch.Generator(),
        cpu,
    )
    assert at_one == one_by_one and model.calls == 12  # nothing is that sure: the top one per step
    model.calls = 0
    sample_diffusion(
        model,
        prompt,
        MASK,
        DiffusionSampling(length=12, steps=12, block_length=4, threshold=1e-9),
        torch.Generator(),
        cpu,
    )
    assert model.calls == 3  # every position sure enough: one step per block
    with pytest.raises(ValueError, match=r"--threshold must be in \(0, 1\]"):
        DiffusionSampling(length=8, steps=8, block_length=8, threshold=1.5).check()
    with pytest.raises(ValueError, match="use it with --order confidence"):
        DiffusionSampling(length=8, steps=8, block_length=8, threshold=0.9, order="margin").check()


@pytest.mark.parametrize("threshold", [None, 0.05])
def test_a_prompt_gets_the_same_greedy_text_alone_and_in_a_batch_with_longer_prompts(threshold):
    """Prompts of different lengths are left-padded and the padding masked out of attention."""
    model, cpu = _model(causal=False), torch.device("cpu")
    prompts = [[29, 3], [29, 5, 6, 7, 8, 1, 2], [29, 4, 4, 9]]
    how = DiffusionSampling(length=8, steps=8, block_length=4, threshold=threshold)
    together = sample_diffusion_batch(model, prompts, MASK, how, torch.Generator(), cpu)
    alone = [sample_diffusion(model, p, MASK, how, torch.Generator(), cpu) for p in prompts]
    assert together == alone and all(MASK not in t for t in together)


def test_the_prefix_cache_gives_the_tail_the_logits_of_the_whole_canvas():
    """Recorded from a canvas, the cached prefix's keys and values plus a forward over the tail at
    its own positions give the tail exactly the logits a whole-canvas forward gives it (left
    padding masked out of attention too), and a changed tail token is seen."""
    from muloco.models.attention import kv_cache
    from muloco.objectives.sampling import _left_padded, _logits

    model, cpu = _model(causal=False), torch.device("cpu")
    x, start, kwargs = _left_padded([[29, 3, 4], [29, 5, 6, 7, 8]], MASK, 12, cpu)
    first = start + 4
    whole = _logits(model, x, 0, MASK, kwargs)
    with kv_cache(model) as cache:
        cache.prefix, cache.recording = first, True
        torch.testing.assert_close(_logits(model, x, 0, MASK, kwargs), whole, rtol=0, atol=0)
        cache.recording = False
        torch.testing.assert_close(_logits(model, x, first, MASK, kwargs), whole[:, first:], rtol=1e-5, atol=1e-5)
        y = x.clone()
        y[:, first + 2] = 11  # a token of the tail changes: the tail's logits see it
        assert (_logits(model, y, first, MASK, kwargs) - whole[:, first:])[..., :MASK].abs().max() > 1e-3
    assert all(m.prefix_cache is None for m in model.modules() if hasattr(m, "prefix_cache"))
    with pytest.raises(ValueError, match="bidirectional"):
        with kv_cache(_model(causal=True)):
            pass


def test_the_dual_cache_gives_the_block_the_logits_of_the_whole_canvas():
    """Recorded from a canvas, the kept prefix and suffix plus a forward over the block alone at its
    own positions give the block exactly the logits a whole-canvas forward gives it (left padding
    masked out of attention too); a changed block token is seen, a changed suffix token is not
    (the suffix is kept from the recording: Fast-dLLM's approximation)."""
    from muloco.models.attention import kv_cache
    from muloco.objectives.sampling import _left_padded, _logits

    model, cpu = _model(causal=False), torch.device("cpu")
    x, start, kwargs = _left_padded([[29, 3, 4], [29, 5, 6, 7, 8]], MASK, 12, cpu)
    first, stop = start + 4, start + 8
    whole = _logits(model, x, 0, MASK, kwargs)
    with kv_cache(model) as cache:
        cache.prefix, cache.suffix, cache.recording = first, stop, True
        torch.testing.assert_close(_logits(model, x, 0, MASK, kwargs), whole, rtol=0, atol=0)
        cache.recording = False
        block = _logits(model, x, first, MASK, kwargs, None, stop)
        assert block.shape[1] == stop - first
        torch.testing.assert_close(block, whole[:, first:stop], rtol=1e-5, atol=1e-5)
        y = x.clone()
        y[:, first + 1] = 11  # a token of the block changes: the block's logits see it
        assert (_logits(model, y, first, MASK, kwargs, None, stop) - block)[..., :MASK].abs().max() > 1e-3
        z = x.clone()
        z[:, stop + 1] = 11  # a token after the block: its kept keys stand in for it
        torch.testing.assert_close(_logits(model, z, first, MASK, kwargs, None, stop), block, rtol=0, atol=0)


def test_prefix_cache_sampling_fills_every_mask_and_the_default_is_unchanged():
    model, cpu = _model(causal=False), torch.device("cpu")
    prompts = [[29, 3, 4, 5], [29, 6]]
    plain = DiffusionSampling(length=12, steps=12, block_length=4)
    cached = DiffusionSampling(length=12, steps=12, block_length=4, cache="prefix")
    a = sample_diffusion_batch(model, prompts, MASK, cached, torch.Generator(), cpu)
    assert all(len(t) == 12 and MASK not in t for t in a)
    assert sample_diffusion_batch(model, prompts, MASK, plain, torch.Generator(), cpu) == [
        sample_diffusion(model, p, MASK, plain, torch.Generator(), cpu) for p in prompts
    ]
    dual = DiffusionSampling(length=12, steps=12, block_length=4, cache="dual")
    b = sample_diffusion_batch(model, prompts, MASK, dual, torch.Generator(), cpu)
    assert all(len(t) == 12 and MASK not in t for t in b)
    with pytest.raises(ValueError, match="--cache must be one of none, prefix, dual, block"):
        DiffusionSampling(length=8, steps=8, block_length=8, cache="blocks").check()


def test_autoregressive_sampler_stops_at_eos_and_repeats_with_a_seed():
    model = _model(causal=True)
    a = sample_autoregressive(model, [29, 3], EOS, 16, 1.0, torch.Generator().manual_seed(5), torch.device("cpu"))
    b = sample_autoregressive(model, [29, 3], EOS, 16, 1.0, torch.Generator().manual_seed(5), torch.device("cpu"))
    assert a == b and 1 <= len(a) <= 16 and (EOS not in a[:-1])


CUT_STEP = textwrap.dedent(
    """
    import json, os, sys
    from muloco import compat
    compat.apply()
    import torch
    import torch.distributed as dist
    from torchtitan.components.loss import IGNORE_INDEX
    from muloco.config.cli import parse_args
    from muloco.objectives import NoiseKey
    from muloco.trainer import MulocoTrainer

    dump, args = sys.argv[1], sys.argv[2:]
    _, config = parse_args(args + ["--dump_folder", dump])
    trainer = MulocoTrainer(config)
    obj, model, dl = trainer.objective, trainer.model_parts[0], trainer.dataloader
    rank, world, accumulation = dl.dp_rank, dl.dp_world_size, trainer.gradient_accumulation_steps
    batches = iter(config.dataloader.build(dp_world_size=world, dp_rank=rank, tokenizer=trainer.tokenizer,
                                           seq_len=config.training.seq_len,
                                           local_batch_size=config.training.local_batch_size))
    sums = torch.zeros(4, dtype=torch.float64)  # Σ w·CE, tokens left, tokens before the cut, cut micro-batches
    with torch.no_grad():
        for micro in range(accumulation):
            inputs, labels = next(batches)
            x, full = inputs["input"], labels
            key = NoiseKey(replica=0, step=1, micro=micro, rank=rank, world=world)
            x, labels = obj.truncate(x, labels, key)
            batch = obj.prepare(x, labels, key)
            sums += torch.tensor([obj.loss(model(batch.inputs, **batch.model_kwargs), batch).item(),
                                  (labels != IGNORE_INDEX).sum().item(), (full != IGNORE_INDEX).sum().item(),
                                  float(labels.shape[1] < full.shape[1])], dtype=torch.float64)
    dist.all_reduce(sums)
    trainer.train()
    if rank == 0:
        logged = next(r for r in map(json.loads, open(os.path.join(dump, "metrics.jsonl"))) if "loss" in r)
        print("RESULT " + json.dumps({"logged": logged["loss"], "step": logged["step"],
                                      "hand": (sums[0] / sums[1]).item(),
                                      "before_cut": (sums[0] / sums[2]).item(), "cut": sums[3].item(),
                                      "micro": accumulation}), flush=True)
    dist.destroy_process_group()
    os._exit(0)
    """
)


@pytest.mark.timeout(400)
def test_a_cut_step_is_normalised_by_the_tokens_that_remain_on_every_rank_under_accumulation(tmp_path):
    """Every micro-batch of the step cut to a random length (probability 1), two ranks, two
    accumulation steps: the logged loss is Σ w·CE over both ranks and micro-batches divided by the
    maskable tokens left after the cuts (LLaDA's loss of a cut batch), computed by hand from the
    same batches and the model before its first update; not by the count from before the cut."""
    script = tmp_path / "cut_step.py"
    script.write_text(CUT_STEP)
    args = [
        "--config",
        "ddp/adamw",
        "--objective",
        "mdlm",
        *TINY,
        "--training.global_batch_size",
        "16",
        "--objective.truncate_probability",
        "1.0",
        "--training.steps",
        "1",
        "--metrics.log_freq",
        "1",
        "--validator.no-enable",
        "--checkpoint.no-enable",
    ]
    results = run_gloo_ranks(script, 2, [str(tmp_path / "run"), *args], quiet_s=300)
    assert all(code == 0 for code, _ in results), [out[-3000:] for _, out in results]
    got = json.loads(next(ln for ln in results[0][1].splitlines() if ln.startswith("RESULT "))[7:])
    assert got["step"] == 1 and got["micro"] == 2 and got["cut"] == 4  # 2 ranks x 2 micro-batches, all cut
    assert got["logged"] == pytest.approx(got["hand"], rel=1e-5), got
    assert abs(got["before_cut"] - got["hand"]) > 1e-3 * got["hand"], got  # the check can fail


def test_the_loader_makes_every_token_of_a_pretraining_row_a_target_eos_included():
    from muloco.data.loader import PackedTextDataLoader
    from muloco.data.tokenizer import MulocoTokenizer

    tok = MulocoTokenizer()
    loader = PackedTextDataLoader.Config(next_token=False).build(
        dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=256, local_batch_size=4
    )
    inputs, labels = next(iter(loader))
    assert torch.equal(labels, inputs["input"]) and (labels == tok.eos_id).any() and (labels == tok.bos_id).any()


def _counting_rows(g: torch.Generator, rows: int = 8, n: int = 32) -> torch.Tensor:
    """Packed short documents whose text says where they end: [bos, s, s+1, …, 12, eos]."""
    stream: list[int] = []
    while len(stream) < rows * n:
        s = int(torch.randint(0, 10, (), generator=g))
        stream += [BOS, *range(s, 13), EOS]
    return torch.tensor(stream[: rows * n]).view(rows, n)


def _train_counting(eos_is_target: bool, steps: int = 150):
    from torchtitan.components.loss import IGNORE_INDEX

    from muloco.objectives import MaskedDiffusion, NoiseKey, SpecialTokens

    model = tiny_model(False, seed=0).train()
    obj = MaskedDiffusion.Config(truncate_probability=0.0, masked_only_head=False).build(
        tokens=SpecialTokens(bos=BOS, eos=EOS, mask=MASK), rows_per_step=8
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = _counting_rows(g)
        labels = x.clone() if eos_is_target else x.masked_fill((x == BOS) | (x == EOS), IGNORE_INDEX)
        batch = obj.prepare(x, labels, NoiseKey(0, step, 0, 0, 1))
        loss = obj.loss(model(batch.inputs, **batch.model_kwargs), batch, (labels != IGNORE_INDEX).sum())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_a_model_trained_with_eos_as_a_target_learns_to_stop():
    """Short counting documents, 150 steps, greedy samples of 16 tokens after [bos, s]: trained
    with EOS masked and scored (what the loader now does) the samples end with EOS where the text
    ends (seen here: 10 of 10); trained the old way (BOS and EOS never targets) they never do and
    run to the length cap (0 of 10)."""
    how = DiffusionSampling(length=16, steps=16, block_length=16)
    stops = {}
    for eos_is_target in (True, False):
        model = _train_counting(eos_is_target)
        samples = [
            sample_diffusion(model, [BOS, s], MASK, how, torch.Generator().manual_seed(s), torch.device("cpu"))
            for s in range(10)
        ]
        stops[eos_is_target] = [EOS in out for out in samples]
    assert sum(stops[True]) >= 8 and sum(stops[True]) > sum(stops[False]), stops
