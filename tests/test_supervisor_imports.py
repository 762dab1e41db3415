"""Modules Xinference's supervisor imports at start load with xoscar alone."""

import os
import subprocess
import sys

CHECK = r"""
import importlib, importlib.abc, importlib.util, sys

class Blocker(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # lets torch/vLLM be *found* (xoscar probes with find_spec) but never executed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "vllm"):
            return importlib.util.spec_from_loader(name, self)
        return None
    def create_module(self, spec):
        raise ImportError(f"blocked import of {spec.name}")
    def exec_module(self, module):
        raise ImportError(f"blocked import of {module.__name__}")

sys.meta_path.insert(0, Blocker())
import _xinference_xavier_overlay as overlay
# load the fork package itself without upstream's parents: `xinference.model`
# imports torch and vLLM on its own (upstream behaviour, measured ~20 s)
spec = overlay.XavierOverlayFinder.find_spec(overlay.TARGET)
pkg = importlib.util.module_from_spec(spec)
sys.modules[overlay.TARGET] = pkg
spec.loader.exec_module(pkg)
for name in ("block_tracker", "collective_manager", "transport"):
    importlib.import_module(f"{overlay.TARGET}.{name}")
from xinference.model.llm.vllm.xavier.block_tracker import VLLMBlockTracker
from xinference.model.llm.vllm.xavier.collective_manager import CollectiveManager, Rank0ModelActor
from xinference.model.llm.vllm.xavier.transport import normalize_xavier_transport_backend
assert normalize_xavier_transport_backend(None) == "xavier"
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "vllm"))
print("HEAVY", heavy)
print("XOSCAR", "xoscar" in sys.modules)
"""


def run_check(extra=""):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", CHECK + extra], capture_output=True, text=True,
                          env=env, timeout=120)


def test_supervisor_time_modules_need_neither_torch_nor_vllm():
    proc = run_check()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HEAVY []" in proc.stdout and "XOSCAR True" in proc.stdout


def test_blocker_catches_a_heavy_import():
    """Negative control: the same harness fails when a supervisor-time module pulls torch."""
    proc = run_check("importlib.import_module(f'{overlay.TARGET}.mechanism.gpu_transfer')\n")
    assert proc.returncode != 0 and "blocked import of torch" in proc.stderr


def test_planning_layer_needs_neither_torch_nor_vllm():
    """The planning folder is the numpy-only layer (doc/architecture.md): every module of it
    loads under the same blocker."""
    import pkgutil

    from xinference.model.llm.vllm.xavier import planning
    names = sorted(m.name for m in pkgutil.iter_modules(planning.__path__))
    assert "plan" in names and "load_batch" in names
    loads = "".join(f"importlib.import_module(f'{{overlay.TARGET}}.planning.{n}')\n" for n in names)
    proc = run_check(loads + "print('HEAVY2', sorted(m for m in sys.modules "
                             "if m.split('.')[0] in ('torch', 'vllm')))\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HEAVY2 []" in proc.stdout
