"""The overlay in Xinference 3.5.0's per-model virtualenvs (on by default): the real
``WorkerActor._create_virtual_env_manager`` prepares a child venv, whose interpreter must
then import this fork's package; without the bootstrap file it gets upstream's."""

import os
import subprocess
import sys

import pytest

PROBE = ("import xinference.model.llm.vllm.xavier as x; "
         "print(getattr(x, 'XAVIER_FORK', False), x.__file__)")

FORK_PROBE = ("import sys, _xinference_xavier_fork.planning.slot_allocator as f; "
              "light = 'xinference.model' not in sys.modules; "
              "import xinference.model.llm.vllm.xavier.planning.slot_allocator as p; "
              "print(light, f is p)")


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def child_venv(tmp_path_factory):
    env_path = str(tmp_path_factory.mktemp("model-venv") / "env")
    make = ("import sys, xinference.core.worker as w; "
            f"m = w.WorkerActor._create_virtual_env_manager(True, None, {env_path!r}); "
            "print(m.get_lib_path())")
    out = run([sys.executable, "-c", make])
    assert out.returncode == 0, out.stderr[-3000:]
    lib = out.stdout.strip().splitlines()[-1]
    return env_path, lib


def test_child_venv_imports_the_fork(child_venv):
    env_path, lib = child_venv
    assert os.path.exists(os.path.join(lib, "_xinference_parent.pth"))  # upstream's own file
    assert os.path.exists(os.path.join(lib, "xinference_xavier_overlay.pth"))
    out = run([os.path.join(env_path, "bin", "python"), "-c", PROBE])
    assert out.returncode == 0, out.stderr[-3000:]
    flag, path = out.stdout.strip().splitlines()[-1].split()
    assert flag == "True"
    assert "site-packages/xinference/" not in path
    # vLLM's engine processes load the connector by the installed name: in the child venv
    # (no editable finder there) the overlay finds it, and it is the public name's module
    out = run([os.path.join(env_path, "bin", "python"), "-c", FORK_PROBE])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True True"


def test_negative_control_without_the_bootstrap_upstream_is_served(child_venv):
    env_path, lib = child_venv
    pth = os.path.join(lib, "xinference_xavier_overlay.pth")
    saved = open(pth).read()
    os.remove(pth)
    try:
        out = run([os.path.join(env_path, "bin", "python"), "-c", PROBE])
        assert out.returncode == 0, out.stderr[-3000:]
        flag, path = out.stdout.strip().splitlines()[-1].split()
        assert flag == "False" and "site-packages/xinference/" in path
    finally:
        with open(pth, "w") as f:
            f.write(saved)
