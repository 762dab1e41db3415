"""The import overlay in fresh processes: editable, regular wheel, xoscar sub pool, spawn."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata as md
import json
import os
import pathlib
import subprocess
import sys
import sysconfig
import zipfile

import pytest
import xoscar as xo

import _xinference_xavier_overlay as overlay

from .support.pools import actor_pool, sub_pool_addresses

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORK_DIR = os.path.join(REPO, "xinference", "model", "llm", "vllm", "xavier")
UPSTREAM_DIR = os.path.join(sysconfig.get_paths()["purelib"], "xinference")

REPORT = r"""
import json, multiprocessing as mp, sys
def where():
    import xinference.model.llm.vllm.xavier as x
    return x.__file__, getattr(x, "XAVIER_FORK", False)
if __name__ == "__main__":
    out = {"main": where()}
    if "--spawn" in sys.argv:
        with mp.get_context("spawn").Pool(1) as pool:
            out["spawned"] = pool.apply(where)
    print("REPORT " + json.dumps(out))
"""


def run_report(tmp_path, *args, env=None, python_args=()):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    full_env = dict(os.environ, **(env or {}))
    full_env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, *python_args, str(script), *args],
                          capture_output=True, text=True, env=full_env, cwd=str(tmp_path),
                          timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT "):])


def upstream_tree_digest() -> str:
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(UPSTREAM_DIR)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(os.path.relpath(p, UPSTREAM_DIR).encode())
            with open(p, "rb") as fh:
                h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def test_fresh_interpreter_and_spawned_child_get_the_fork(tmp_path):
    out = run_report(tmp_path, "--spawn")
    for where in ("main", "spawned"):
        path, fork = out[where]
        assert fork is True
        assert os.path.realpath(path) == os.path.realpath(os.path.join(FORK_DIR, "__init__.py"))


ALIASES = r"""
import json, logging, sys
import _xinference_xavier_fork.planning.hash_seed as by_fork
import _xinference_xavier_fork.transfer
light = "xinference.model" not in sys.modules
import xinference.model.llm.vllm.xavier.planning.hash_seed as by_public
import xinference.model.llm.vllm.xavier as public_pkg, _xinference_xavier_fork as fork_pkg
import xinference.model.llm.vllm.xavier.transfer
# the other order (what Xinference does): a module first imported by the public name
assert "_xinference_xavier_fork.planning.slot_allocator" not in sys.modules
import xinference.model.llm.vllm.xavier.planning.slot_allocator as public_first
print("REPORT " + json.dumps({
    "light": light,
    "same_submodule": by_fork is by_public,
    "same_package": public_pkg is fork_pkg,
    "same_in_sys_modules": sys.modules["xinference.model.llm.vllm.xavier.transfer"]
        is sys.modules["_xinference_xavier_fork.transfer"],
    "spec_name": by_public.__spec__.name,
    "public_first": [public_first.__name__, public_first.__spec__.name,
                     sys.modules["_xinference_xavier_fork.planning.slot_allocator"] is public_first,
                     public_pkg.planning.slot_allocator is public_first],
    "logger": _xinference_xavier_fork.transfer.logger.name,
}))
"""


def test_public_name_is_an_alias_and_the_fork_name_skips_upstream_model_package(tmp_path):
    """vLLM's engine processes import the connector by the installed name: that must not
    run upstream's ``xinference/model/__init__.py`` (every model family, ~8 s of CPU per
    process), and the public name must give the very same module objects (one class, one
    registry), with loggers under the public name users configure."""
    script = tmp_path / "aliases.py"
    script.write_text(ALIASES)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, cwd=str(tmp_path), timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("REPORT "):])
    assert out == {
        "light": True,
        "same_submodule": True,
        "same_package": True,
        "same_in_sys_modules": True,
        "spec_name": "_xinference_xavier_fork.planning.hash_seed",
        "public_first": ["_xinference_xavier_fork.planning.slot_allocator",
                         "_xinference_xavier_fork.planning.slot_allocator", True, True],
        "logger": "xinference.model.llm.vllm.xavier.transfer",
    }


def test_overlay_off_serves_upstream(tmp_path):
    out = run_report(tmp_path, env={overlay.ENV_SWITCH: "0"})
    path, fork = out["main"]
    assert fork is False
    assert os.path.realpath(path).startswith(os.path.realpath(UPSTREAM_DIR))


def test_xoscar_sub_pool_gets_the_fork():
    from .support.probe_actor import OverlayProbeActor

    async def run():
        async with actor_pool(n_process=1) as pool:
            sub = sub_pool_addresses(pool)[0]
            ref = await xo.create_actor(OverlayProbeActor, address=sub, uid="overlay-probe")
            return await ref.where()

    info = asyncio.run(run())
    assert info["pid"] != os.getpid()
    assert info["fork"] is True and info["overlay_active"] is True
    assert os.path.realpath(info["transport"]) == os.path.realpath(
        os.path.join(FORK_DIR, "transport.py"))


def test_upstream_files_match_their_install_record():
    """Every file pip recorded for xinference 3.5.0 still has its recorded hash."""
    dist = md.distribution("xinference")
    assert dist.version == "3.5.0"
    checked = 0
    for f in dist.files or []:
        if f.hash is None or "__pycache__" in str(f):
            continue
        data = f.locate().read_bytes()
        digest = hashlib.new(f.hash.mode, data).digest()
        import base64

        assert base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == f.hash.value, str(f)
        checked += 1
    assert checked > 500


@pytest.mark.slow
def test_regular_wheel_install_leaves_upstream_untouched(tmp_path):
    """Build a regular wheel, install it into a separate site dir: it ships no upstream
    path, upstream's tree hashes the same before and after, and a fresh interpreter
    with that site dir serves the installed copy of the fork."""
    before = upstream_tree_digest()
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheel_dir), REPO], check=True, timeout=600)
    (wheel,) = wheel_dir.glob("xinference_xavier-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "xinference_xavier_overlay.pth" in names
    fork_dir = pathlib.Path(REPO) / "xinference/model/llm/vllm/xavier"
    sources = {"_xinference_xavier_fork/" + p.relative_to(fork_dir).as_posix()
               for p in fork_dir.rglob("*.py") if "__pycache__" not in p.parts}
    shipped = {n for n in names if n.startswith("_xinference_xavier_fork/")}
    assert "_xinference_xavier_fork/planning/plan.py" in sources
    assert shipped == sources, (sorted(shipped - sources), sorted(sources - shipped))
    assert not [n for n in names if n.startswith("xinference/")]
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, timeout=600)
    venv_site = sysconfig.get_paths()["purelib"]
    boot = tmp_path / "boot.py"
    boot.write_text(
        "import site, sys, runpy\n"
        f"site.addsitedir({str(target)!r})\n"
        f"site.addsitedir({venv_site!r})\n"
        f"runpy.run_path({str(tmp_path / 'report.py')!r}, run_name='__main__')\n")
    (tmp_path / "report.py").write_text(REPORT)
    proc = subprocess.run([sys.executable, "-S", str(boot)], capture_output=True, text=True,
                          timeout=300, cwd=str(tmp_path),
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    path, fork = json.loads(line[-1][7:])["main"]
    assert fork is True and path.startswith(str(target / "_xinference_xavier_fork"))
    assert upstream_tree_digest() == before


def test_the_package_s_two_names_agree_with_the_overlay_s():
    """The package spells its two names itself (it must not import the overlay module):
    they must be the overlay's."""
    from xinference.model.llm.vllm.xavier.planning import log_names

    assert log_names.PUBLIC_PACKAGE == overlay.TARGET
    assert log_names.INSTALLED_PACKAGE == overlay.FORK_PACKAGE
