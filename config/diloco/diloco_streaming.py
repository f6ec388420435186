"""Streaming DiLoCo: the model in fragments synced in turn, each exchange overlapping τ steps.

With H=30 and 3 fragments one third of the model crosses the network every 10 steps
(peak bandwidth / 3); τ=2 lets each exchange run behind two inner steps; α=0.5
keeps half of the local progress made during the overlap.
"""

from muloco.config import load_config


def config():
    c = load_config("diloco/diloco")
    c.dump_folder = "./outputs/diloco-streaming"
    c.outer.num_fragments = 3
    c.outer.fragment_sync_delay = 2
    c.outer.fragment_update_alpha = 0.5
    return c
