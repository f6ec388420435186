"""Fault drills for processes a test does not start itself (a SLURM job's ranks, through
torchrun): put this folder on ``PYTHONPATH`` with ``MULOCO_TEST_DRILLS`` set, and the drills of
``tests/drill_train.py`` are installed when a trainer (DDP or DiLoCo) starts to build. A process
that never imports the trainer (the lighthouse, torchrun's agent) is left alone."""

import os
import sys

if os.environ.get("MULOCO_TEST_DRILLS"):
    import importlib.abc
    import importlib.machinery

    class _InstallDrillsAfterTrainerImport(importlib.abc.MetaPathFinder):
        target = "muloco.trainer"

        def find_spec(self, name, path, target=None):
            if name != self.target:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                mixin = module.MulocoTrainerMixin
                resolve = mixin._resolve

                def _resolve(self, config):  # first thing every trainer does: every module is imported
                    mixin._resolve = resolve
                    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
                    import drill_train

                    drill_train.install_from_env(sys.argv[1:])
                    return resolve(self, config)

                mixin._resolve = _resolve

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _InstallDrillsAfterTrainerImport())
