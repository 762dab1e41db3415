"""The package's logger names: every module logs as ``xinference.model.llm.vllm.xavier.*``
(under Xinference's ``xinference`` logger, whose handlers and level Xinference configures),
whichever of its two names loaded it: the import overlay serves the package installed as
``_xinference_xavier_fork`` under that public name too, and a process that needs only
Xavier (vLLM's engine processes, an xoscar sub pool) imports it by the installed name."""

from __future__ import annotations

import logging

#: the name users and Xinference import the package by
PUBLIC_PACKAGE = "xinference.model.llm.vllm.xavier"
#: the top-level name the package's files are installed under (``setup.py``)
INSTALLED_PACKAGE = "_xinference_xavier_fork"


def public_name(module_name: str) -> str:
    """``module_name`` (a ``__name__``) under :data:`PUBLIC_PACKAGE`."""
    if module_name == INSTALLED_PACKAGE or module_name.startswith(INSTALLED_PACKAGE + "."):
        return PUBLIC_PACKAGE + module_name[len(INSTALLED_PACKAGE):]
    return module_name


def package_logger(module_name: str) -> logging.Logger:
    """The logger of the module named ``module_name`` (pass ``__name__``)."""
    return logging.getLogger(public_name(module_name))
