"""A run's folder, the format every layer shares: the facts a run records (``facts``), the checksum
manifest that seals each checkpoint (``manifest``), the lock that keeps two runs out of one folder
(``lock``), and a sweep folder's list of its runs (``sweep_manifest``). Torch-free; the trainer
writes them, the launcher and the tools read them."""
