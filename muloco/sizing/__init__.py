"""Sizing a run before it is booked: the model map (``flavors``: shapes, parameter counts, token
budgets, tuned values), the link model (``link_model``: what a transfer costs on a link of given
bandwidth and latency), the link planner (``link_plan``) and their command line (``cli``,
``muloco map``). Nothing here imports torch but the planner, which reads the exchange's wire format."""
