"""Find and run config modules.

A config module is a Python file under the project's ``config/`` folder (or any
path) with a function ``config()`` returning a complete trainer config, usually by
calling its parent's: ``c = load_config("base"); c.training.steps = 100; return c``.
Names may be given as ``ddp/adamw``, ``ddp.adamw``, ``config/ddp/adamw.py`` or an
absolute path.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

from muloco import compat
from muloco.utils.errors import BadInput

CONFIG_FUNCTION = "config"


class ConfigError(BadInput, ValueError):
    """A config that cannot run; the message names the key, the problem and the fix."""


def config_root() -> Path:
    """The project's config folder (MULOCO_CONFIG_DIR overrides it)."""
    env = os.environ.get("MULOCO_CONFIG_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "config"


def available_configs() -> list[str]:
    root = config_root()
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.py") if p.name != "__init__.py")


def resolve_config_path(name: str) -> Path:
    candidates = [Path(name)]
    stem = name[:-3] if name.endswith(".py") else name
    rel = stem.replace(".", "/") if "/" not in stem and not stem.startswith(".") else stem
    candidates += [config_root() / f"{rel}.py", config_root() / f"{stem}.py"]
    if stem.startswith("config/"):
        candidates.append(config_root() / f"{stem[len('config/') :]}.py")
    for path in candidates:
        if path.is_file():
            return path.resolve()
    raise ConfigError(
        f"--config '{name}' is not a config module. Available: "
        f"{', '.join(available_configs()) or '(none found in ' + str(config_root()) + ')'}; "
        "or pass a path to a .py file that defines config()."
    )


def _frames(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _where(err: BaseException, path: Path) -> str:
    """``<path>, line N``: the innermost line of the config module where ``err`` was raised."""
    if isinstance(err, SyntaxError) and err.filename and Path(err.filename).resolve() == path:
        return f"{path}, line {err.lineno}"
    lines = [tb.tb_lineno for tb in _frames(err.__traceback__) if Path(tb.tb_frame.f_code.co_filename) == path]
    return f"{path}, line {lines[-1]}" if lines else str(path)


def _describe(err: BaseException) -> str:
    if isinstance(err, SyntaxError):
        return f"syntax error: {err.msg}"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _import_file(path: Path) -> ModuleType:
    compat.apply()  # a config module imports torchtitan, which must be adapted first (idempotent)
    module_name = "muloco_config_" + "_".join(path.with_suffix("").parts[-3:]).replace("-", "_")
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_module(path: Path):
    """Import the module and call its ``config()``. A parent module's ConfigError passes
    through unchanged (it already names its own file); any other exception becomes one
    ConfigError naming this file and the line that raised, instead of a traceback."""
    try:
        fn = getattr(_import_file(path), CONFIG_FUNCTION, None)
        if not callable(fn):
            raise ConfigError(
                f"config module {path} has no function {CONFIG_FUNCTION}(); define "
                f"'def {CONFIG_FUNCTION}():' returning a trainer config (see config/base.py)."
            )
        return fn()
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - user code, reported with its file and line
        raise ConfigError(f"config module {_where(err, path)}: {_describe(err)}; fix the module.") from None


def _check_type(result, path: Path):
    from torchtitan.trainer import Trainer  # imported by the config module already: costs nothing here

    if not isinstance(result, Trainer.Config):
        raise ConfigError(
            f"config module {path}: {CONFIG_FUNCTION}() returned {type(result).__name__}, not a "
            "trainer config; return the config that load_config(...) or MulocoTrainer.Config() gives."
        )
    return result


def load_config(name: str):
    """Run config module ``name`` and return the config its ``config()`` builds."""
    path = resolve_config_path(name)
    return _check_type(_run_module(path), path)


def derive(config, cls):
    """``config``'s settings in another Config class (e.g. a DiLoCo config from the base one).

    Fields the target lacks are dropped; nested configs whose class differs (the
    checkpointer of a replica group) are converted the same way, field by field.
    """
    import dataclasses

    new = cls()
    for f in dataclasses.fields(config):
        if not f.init or not hasattr(new, f.name):
            continue
        value, target = getattr(config, f.name), getattr(new, f.name)
        if dataclasses.is_dataclass(value) and dataclasses.is_dataclass(target) and type(value) is not type(target):
            value = derive(value, type(target))
        setattr(new, f.name, value)
    return new
