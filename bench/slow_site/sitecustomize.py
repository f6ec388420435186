"""A slower replica group for ``bench/unequal_groups.py`` and ``bench/round_modes.py``: put this folder on
``PYTHONPATH`` with
``MULOCO_BENCH_SLOW=REPLICA:SECONDS`` and that group's trainer sleeps SECONDS after each inner step
(inside the step, before the outer loop sees it: to its peers it is a group on slower GPUs). The
setting is the bench's, read here; muloco reads nothing of it. Other groups, and processes that
never import the trainer (the lighthouse, torchrun's agent), are left alone."""

import os
import sys

if os.environ.get("MULOCO_BENCH_SLOW"):
    import importlib.abc
    import importlib.machinery

    def _replica_id(argv):
        for i, arg in enumerate(argv):
            if arg == "--fault_tolerance.replica_id":
                return int(argv[i + 1])
            if arg.startswith("--fault_tolerance.replica_id="):
                return int(arg.split("=", 1)[1])
        return 0

    class _SlowAfterTrainerImport(importlib.abc.MetaPathFinder):
        target = "muloco.trainer"

        def find_spec(self, name, path, target=None):
            if name != self.target:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            replica, seconds = os.environ["MULOCO_BENCH_SLOW"].split(":")
            if spec is None or spec.loader is None or int(replica) != _replica_id(sys.argv[1:]):
                return spec
            execute = spec.loader.exec_module

            def exec_module(module):
                import time

                execute(module)
                mixin = module.MulocoTrainerMixin
                step = mixin.train_step

                def train_step(self, data_iterator):
                    out = step(self, data_iterator)
                    time.sleep(float(seconds))
                    return out

                mixin.train_step = train_step

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _SlowAfterTrainerImport())
