"""The checkout's root must not shadow an installed package: `python -m ...` and pytest put the root on
sys.path, so a root folder with an `__init__.py` wins over a distribution's module of the same name.
transformers 5.25 depends on Hugging Face's `kernels` and imports it from its activations module; while
the C++ kernels lived in a root folder `kernels/`, every transformers model or tokenizer load started
from the checkout failed (`cannot import name 'CUDAProperties' from 'kernels'`)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_root_package_shares_a_name_with_an_installed_distribution() -> None:
    root_packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    installed = importlib.metadata.packages_distributions()  # top-level module -> distributions
    clashes = {name: installed[name] for name in root_packages if name in installed and name != "treespec"}
    assert not clashes, f"root folders shadow installed packages: {clashes}"


def test_transformers_loads_a_model_config_from_the_checkout_root() -> None:
    """What the server and the tests do from the root (grammar tokenizer info, the test models)."""
    code = "from transformers import LlamaConfig, PreTrainedTokenizerFast; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
