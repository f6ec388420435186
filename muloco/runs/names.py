"""A run's folder name, from its parsed config's facts: method, objective, flavor, K, H, codec,
learning rates and outer step (readable, unique within a sweep, stable across versions); sweeps,
``--local`` sweeps and ``compare`` name their runs with it."""

from __future__ import annotations

from pathlib import Path

from muloco.runs.facts import facts_of
from muloco.utils.link_model import format_rate


def _codec_detail(outer: dict) -> str:
    """What the method's name does not say about a lossy codec: top-k's fraction, error feedback."""
    codec = outer["codec"]
    if codec["lossless"]:
        return ""
    ef = "ef" if outer["error_feedback"]["enabled"] else "noef"
    tiles = f"-tiles{outer['tiles']}" if outer.get("tiles") else ""
    return "-".join(filter(None, [codec["detail"] + (tiles if codec["detail"] else ""), ef]))


def _outer_step_label(outer: dict) -> str:
    """The outer step as a folder name says it: ``olr0.7`` (DiLoCo's Nesterov with μ 0.9), the
    optimizer and μ when they differ (``olr1-sgd``, ``olr0.7-m0.5``, ``avg``), the error-feedback
    β when it is not the compressed configs' 0.95, and each scheduled value (``-msched-w0.1s0.5c0.9``:
    a warmup from 0.5 over 0.1 of the run, then a cosine decay to 0.9; ``-lrsched-inner``)."""
    label = outer["optimizer"]["label"]  # the optimizer's own (``OuterOptimizer.Config.label``)
    ef = outer["error_feedback"]
    if ef["enabled"] and ef["beta"] != 0.95:
        label += f"-b{ef['beta']:g}"
    short = {"lr": "lr", "momentum": "m", "feedback_beta": "b"}
    for name, s in (outer.get("step_schedule") or {}).items():
        tag = f"w{s['warmup']:g}s{s['start']:g}" if s["warmup"] else ""
        if s["decay"] == "inner":
            tag += "inner"
        elif s["decay"] != "none":
            tag += f"{s['decay'][0]}{s['final']:g}" + (f"f{s['decay_from']:g}" if s["decay_from"] else "")
        label += f"-{short[name]}sched-{tag}"
    return label


def _flavor_label(flavor: str) -> str:
    """The flavor as a folder name says it: ``w128-d4-h2``, ``hf-<folder name>`` for ``hf:DIR``."""
    from muloco.models.flavors import hf_folder  # the map, torch-free: this module stays so for compare's CLI

    folder = hf_folder(flavor)
    return f"hf-{Path(folder).resolve().name}" if folder is not None else flavor.replace("llama3-", "")


def run_name(cfg) -> str:
    """method_objective_flavor[_K_H_codec]_lrs[_tuneN], from the parsed config's facts (the method as
    the report names it, defaults included; never from the config module's file name); ``tuneN``: θ_g
    is also scored on N tuning batches (``--validator.tuning_steps``)."""
    facts = facts_of(cfg, environment=False)
    parts = [facts["method"], facts["objective"], _flavor_label(cfg.model.flavor)]
    outer = facts["outer"]
    if outer is not None:
        parts += [f"K{outer['replica_groups']}", f"H{outer['sync_every']}", _codec_detail(outer)]
    parts.append(f"lr{cfg.optimizer.lr:g}")
    if outer is not None:
        parts.append(_outer_step_label(outer))
        if outer.get("link"):  # an emulated link: its own folder (the same training, other wall times)
            parts.append(_link_label(outer["link"]))
    tuning = getattr(cfg.validator, "tuning_steps", 0)
    if tuning:  # scored on tuning batches too: a finished run without them is not reusable for --tune
        parts.append(f"tune{tuning}")
    return "_".join(p for p in parts if p)


def _link_label(link: dict) -> str:
    """``link100mbps``, ``link1gbps-50ms``: the emulated link as a folder name says it."""
    latency = f"-{link['latency_ms']:g}ms" if link.get("latency_ms") else ""
    return "link" + format_rate(link["mbps"]).replace(" ", "").lower() + latency
