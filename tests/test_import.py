"""Importing the core package must not pull in any training framework."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import spawn_ranks

FRAMEWORKS = [
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "transformers",
    "accelerate",
    "deepspeed",
]

CORE_MODULES = [
    "checkpointer",
    "structure",
    "tensorfile",
    "manifest",
    "catalog",
    "retention",
    "commit",
    "lock",
    "config",
    "policy",
    "rng",
    "errors",
    "data",
    "layout",
    "dist",
    "snapshot",
    "background",
    "decision",
    "history",
    "adaptive",
    "preemption",
]

_PROBE = r"""
import json, sys
import resilient_callbacks
from resilient_callbacks import Checkpointer, ResumableSampler
from resilient_callbacks import checkpointer, session, restoring, saving
for m in %(core)r:
    __import__("resilient_callbacks." + m)
print(json.dumps({
    "loaded": sorted(m for m in sys.modules if m.split(".")[0] in %(fw)r),
    "dcp": sorted(
        m for m in sys.modules
        if m.startswith(("resilient_callbacks.dcp", "torch.distributed.checkpoint"))
    ),
}))
"""


def _run(tmp_path, with_fakes: bool) -> dict:
    """The modules a fresh interpreter loaded by importing the core (``loaded``: of the
    frameworks; ``dcp``: of the DCP subpackage and torch's DCP); ``with_fakes``: importable
    fake frameworks first on its path."""
    env = dict(os.environ)
    if with_fakes:
        # Fake, importable frameworks: if the package imported any of them (even inside a
        # try/except ImportError), it would show up in sys.modules.
        fake = tmp_path / "fakes"
        for name in FRAMEWORKS:
            (fake / name).mkdir(parents=True)
            (fake / name / "__init__.py").write_text("IMPORTED = True\n")
        env["PYTHONPATH"] = os.pathsep.join([str(fake), env.get("PYTHONPATH", "")])
    code = _PROBE % {"core": CORE_MODULES, "fw": FRAMEWORKS}
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def core_import(tmp_path_factory) -> dict:
    """:func:`_run` with the fake frameworks, once for the tests below (a fresh interpreter
    that imports torch: seconds of CPU each)."""
    return _run(tmp_path_factory.mktemp("core_import"), with_fakes=True)


@pytest.mark.slow  # suite time: the test below proves it with the frameworks fakes or real
def test_import_does_not_load_frameworks(tmp_path):
    """The same claim as :func:`test_import_does_not_load_frameworks_even_when_installed`
    (which keeps the default suite's proof) with the frameworks as installed: where they are
    all installed, as in the suite's environment, the fakes there prove it as well."""
    out = _run(tmp_path, with_fakes=False)
    assert out["loaded"] == []


def test_the_core_does_not_import_the_dcp_subpackage(core_import):
    assert core_import["dcp"] == []


def test_import_does_not_load_frameworks_even_when_installed(core_import):
    out = core_import
    assert out["loaded"] == [], f"importing resilient_callbacks imported {out['loaded']}"


@pytest.mark.slow
def test_wheel_ships_the_deepspeed_guard_pth(tmp_path) -> None:
    """A built wheel puts resilient_callbacks_ds_guard.pth (and its module) at the top of
    site-packages, where the interpreter runs it at start-up."""
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*cmd, "-w", str(tmp_path), str(root)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "resilient_callbacks_ds_guard.pth" in names
    assert "resilient_callbacks_ds_guard.py" in names
    pth = zipfile.ZipFile(wheel).read("resilient_callbacks_ds_guard.pth").decode()
    assert pth.strip() == "import resilient_callbacks_ds_guard"


@pytest.mark.parametrize(
    ("version", "imports"),
    [("2.8.1+cu126", False), ("2.9.0a0+5228986.nv25.06", True), ("2.13.0+cpu", True)],
)
def test_the_dcp_subpackage_says_which_torch_it_needs(version, imports):
    """resilient_callbacks.dcp needs torch >= 2.9, by release number: an older torch gets an
    ImportError naming both versions, a pre-release or vendor build of 2.9 imports it."""
    from torch_needs import DCP_MISSING

    if imports and DCP_MISSING:  # the version is only a label: the running torch lacks the APIs
        pytest.skip(DCP_MISSING)
    # forked from the session's zygote (torch imported once): the subpackage not imported yet
    code = (
        "import sys, torch\n"
        "assert 'resilient_callbacks.dcp' not in sys.modules\n"
        f"torch.__version__ = {version!r}\n"
        "import resilient_callbacks.dcp\n"
        "print('imported')\n"
    )
    r = spawn_ranks.run_python([sys.executable, "-c", code], timeout=120)
    if imports:
        assert r.returncode == 0 and "imported" in r.stdout, r.stderr
    else:
        assert r.returncode != 0
        assert f"needs torch >= 2.9, found torch {version}" in r.stderr
        assert "works with torch >= 2.4" in r.stderr


def test_the_lightning_adapter_says_which_lightning_it_needs(monkeypatch):
    """Lightning 2.4 resumed inexactly with the callback: importing the adapter there is an
    ImportError naming both versions; 2.5 imports it. (In this process, the adapter's modules
    put back afterwards: two subprocesses importing Lightning took ~12 s of suite time.)"""
    import importlib

    lightning = pytest.importorskip("lightning")
    import resilient_callbacks

    ours = {k: v for k, v in sys.modules.items() if k.startswith("resilient_callbacks.lightning")}
    attribute = resilient_callbacks.__dict__.get("lightning")
    try:
        for version, imports in (("2.4.0", False), ("2.5.6", True)):
            monkeypatch.setattr(lightning, "__version__", version)
            for name in [k for k in sys.modules if k.startswith("resilient_callbacks.lightning")]:
                del sys.modules[name]
            if imports:
                assert importlib.import_module("resilient_callbacks.lightning").ResilientCheckpoint
            else:
                with pytest.raises(
                    ImportError, match=r"needs PyTorch Lightning >= 2\.5, found 2\.4\.0"
                ):
                    importlib.import_module("resilient_callbacks.lightning")
    finally:
        for name in [k for k in sys.modules if k.startswith("resilient_callbacks.lightning")]:
            del sys.modules[name]
        sys.modules.update(ours)
        if attribute is None:
            resilient_callbacks.__dict__.pop("lightning", None)
        else:
            resilient_callbacks.lightning = attribute


def _our_conftest(request: pytest.FixtureRequest) -> Any:
    """tests/conftest.py as pytest loaded it: ``from conftest import`` takes whichever
    conftest.py was put first on sys.path, tests/upstream's once that folder's tests were
    collected (the whole suite), not this folder's."""
    mine = str(Path(__file__).with_name("conftest.py"))
    for plugin in request.config.pluginmanager.get_plugins():
        if getattr(plugin, "__file__", None) == mine:
            return plugin
    raise AssertionError(f"pytest has not loaded {mine}")


def test_every_transformers_test_file_is_left_out_where_the_trainer_cannot_run(request):
    """Each tests/test_*transformers*.py builds on the Transformers Trainer, which transformers 5
    disables below torch 2.5 (``GPT2LMHeadModel requires the PyTorch library``): conftest's
    TRANSFORMERS_FILES leaves them uncollected there. Five were not in it (best, callback_order,
    collator_rng, preempted, settings_killed): their ``importorskip("transformers")`` passes
    where transformers is installed, and their tests failed on the old torch instead of being
    left out."""
    TRANSFORMERS_FILES = _our_conftest(request).TRANSFORMERS_FILES

    files = sorted(p.name for p in Path(__file__).parent.glob("test_*transformers*.py"))
    assert sorted(set(files) - set(TRANSFORMERS_FILES)) == []
    assert sorted(set(TRANSFORMERS_FILES) - set(files)) == []  # (a file renamed or removed)


def test_every_test_file_that_imports_dcp_at_the_top_is_left_out_where_it_cannot(request):
    """A test file that imports resilient_callbacks.dcp at its top cannot be imported where the
    torch is older than dcp needs (its ImportError): conftest's DCP_FILES leaves it uncollected
    there. test_dcp_storage_edges.py and test_sharded_reshard.py were not in it (the latter's
    ``pytestmark = needs_dcp`` comes after its imports): their collection errors interrupted
    the whole suite on torch 2.4."""
    DCP_FILES = _our_conftest(request).DCP_FILES

    importing = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n.startswith("resilient_callbacks.dcp") for n in names):
                importing.append(path.name)
                break
    assert "test_dcp_storage_edges.py" in importing  # (the rule sees what it is for)
    assert sorted(set(importing) - set(DCP_FILES)) == []
