"""A run's folder, the format every layer shares: the facts a run records (``facts``), the checksum
manifest that seals each checkpoint (``manifest``), the lock that keeps two runs out of one folder
(``lock``), a sweep folder's list of its runs (``sweep_manifest``) and a run folder's name
(``names``: what sweeps and ``compare`` call their runs). Torch-free; the trainer
writes them, the launcher and the tools read them."""
