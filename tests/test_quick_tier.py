"""The quick tier (``pytest -m quick``) covers every package folder, and names only tests that exist."""

from __future__ import annotations

import re

from conftest import QUICK, REPO


def test_every_package_folder_has_quick_tests_that_exist():
    folders = sorted(p.name for p in (REPO / "muloco").iterdir() if (p / "__init__.py").is_file())
    assert sorted(QUICK) == folders, "give each folder of muloco/ its quick tests in tests/conftest.py QUICK"
    for folder, modules in QUICK.items():
        for module, names in modules.items():
            source = (REPO / "tests" / module).read_text()
            missing = [n for n in names if not re.search(rf"^def {n}\(", source, re.M)]
            assert not missing, f"QUICK[{folder!r}] names tests {module} does not have: {missing}"
