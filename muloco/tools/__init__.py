"""Commands over a run's folder once it has trained: load its model (``loading``), sample from it,
score it, export it, report on it. They read what the trainer wrote (``muloco.runs``,
``muloco.components.checkpoint``) and are imported by nothing below them."""
