"""The package as `pip install .` puts it, run from the checkout: nothing in the checkout shadows it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def install_copy(site: Path) -> None:
    """Each package's folder under its dotted name, as pyproject's package-dir maps them."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in package_dirs.items():
        shutil.copytree(
            ROOT / folder,
            site / name.replace(".", "/"),
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("__pycache__"),
        )


def test_python_in_the_checkout_runs_the_installed_package(tmp_path):
    """`llama-chat bench` starts children with `python -c`, users `python -m llama_chat`: from the
    checkout's root, both put the checkout first on sys.path."""
    site = tmp_path / "site-packages"
    install_copy(site)
    # -S: the dependencies' folder without the editable install's import hook, as a plain install has
    dependencies = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), dependencies])}
    runs = {
        "-m": ["-m", "llama_chat", "--version"],
        "-c": ["-c", "import llama_chat, llama_chat.inference.weights; print(llama_chat.__file__)"],
    }
    for how, args in runs.items():
        out = subprocess.run([sys.executable, "-S", *args], cwd=ROOT, env=env, capture_output=True, text=True)
        assert out.returncode == 0, f"python {how} from the checkout: {out.stderr.strip().splitlines()[-1:]}"
    assert out.stdout.strip() == str(site / "llama_chat" / "__init__.py")


def test_every_package_folder_is_in_the_distribution():
    """setuptools ships only the packages pyproject lists: a folder of the package missing from the list
    imports in the checkout (editable) and fails in an installed copy."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    for name, folder in setup["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            assert ".".join([name, *parts]) in listed, f"{init.parent} is not in pyproject's packages"
