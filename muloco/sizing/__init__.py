"""Sizing a run before it is booked: the model map's command line (``cli``, ``muloco map``: the map
itself is ``muloco/models/flavors.py``) and the link planner (``link_plan``: what a run's exchange
costs on a link, from ``muloco/utils/link_model.py``). Nothing here imports torch but the planner,
which reads the exchange's wire format."""
