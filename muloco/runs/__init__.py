"""A run's folder, the format every layer shares: the facts a run records (``facts``), the checksum
manifest that seals each checkpoint (``manifest``), the lock that keeps two runs out of one folder
(``lock``). Torch-free; the trainer writes it, the launcher and the tools read it."""
