"""Packaging of the Xavier fork module.

The package directory ``xinference/model/llm/vllm/xavier`` is installed under
the private top-level name ``_xinference_xavier_fork`` (never as
``xinference.*``: upstream's files stay untouched), next to the overlay module
and a ``.pth`` file that activates the overlay in every process.  The ``.pth``
is written for regular wheels (``build_py``) and editable installs
(``editable_wheel``) alike.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

FORK_DIR = os.path.join("xinference", "model", "llm", "vllm", "xavier")
FORK_PACKAGE = "_xinference_xavier_fork"
PTH_NAME = "xinference_xavier_overlay.pth"
PTH_LINE = "import _xinference_xavier_overlay; _xinference_xavier_overlay.install()\n"


def fork_packages():
    here = os.path.dirname(os.path.abspath(__file__))
    pkgs, dirs = [], {}
    for root, subdirs, files in os.walk(os.path.join(here, FORK_DIR)):
        subdirs[:] = [d for d in subdirs if d != "__pycache__"]
        if "__init__.py" not in files:
            continue
        rel = os.path.relpath(root, os.path.join(here, FORK_DIR))
        name = FORK_PACKAGE if rel == "." else FORK_PACKAGE + "." + rel.replace(os.sep, ".")
        pkgs.append(name)
        dirs[name] = os.path.relpath(root, here)
    return pkgs, dirs


def write_pth(directory):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, PTH_NAME), "w") as fh:
        fh.write(PTH_LINE)
    return os.path.join(directory, PTH_NAME)


class BuildPyWithPth(build_py):
    def run(self):
        # setuptools never prunes build_lib: a module moved or deleted in the source would
        # otherwise ship in the next wheel built from the same checkout.
        shutil.rmtree(os.path.join(self.build_lib, FORK_PACKAGE), ignore_errors=True)
        super().run()
        self._pth = write_pth(self.build_lib)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH_NAME)]


class EditableWheelWithPth(editable_wheel):
    def _install_namespaces(self, installation_dir, pth_prefix):
        super()._install_namespaces(installation_dir, pth_prefix)
        write_pth(installation_dir)


packages, package_dir = fork_packages()
setup(
    packages=packages,
    package_dir=package_dir,
    py_modules=["_xinference_xavier_overlay"],
    cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth},
)
