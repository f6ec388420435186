"""Launch helpers: the torchft lighthouse and the local multi-replica launcher."""
