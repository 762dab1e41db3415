"""The package's structure as doc/architecture.md draws it: layers as folders, imports only
downwards, every public class documented, modules of a size a reader takes in at once."""

import ast
import pathlib
import re

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "xinference/model/llm/vllm/xavier"
#: a module may import from its own layer and the layers after it in this list
LAYERS = ["root", "vllm_side", "mechanism", "planning"]
#: Xinference 3.5.0 imports these by path, or the overlay installs them into Xinference
#: (``replica_routing``: the API's router): they stay at the package root
ROOT_MODULES = {"__init__", "block_tracker", "collective_manager", "transport", "transfer",
                "engine", "replica_routing"}
MAX_LINES = 450


def modules():
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def layer_of(path: pathlib.Path, root: pathlib.Path = PKG) -> str:
    rel = path.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else "root"


def imported_layers(path: pathlib.Path, root: pathlib.Path = PKG):
    """(line, layer) of every package-internal import of ``path``."""
    here = path.relative_to(root).parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(here[:len(here) - (node.level - 1)]) if node.level > 1 else list(here)
            parts = base + (node.module.split(".") if node.module else [])
            if not parts:
                names = [a.name for a in node.names]
                parts = [names[0]] if names[0] in LAYERS else []
            yield node.lineno, parts[0] if parts and parts[0] in LAYERS[1:] else "root"


def test_the_root_holds_only_xinference_entry_points_and_the_layer_folders():
    assert {p.stem for p in PKG.glob("*.py")} == ROOT_MODULES
    assert {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(
        LAYERS[1:])


def test_imports_only_go_down_the_layers():
    upward = []
    for path in modules():
        mine = LAYERS.index(layer_of(path))
        for line, layer in imported_layers(path):
            if LAYERS.index(layer) < mine:
                upward.append(f"{path.relative_to(PKG)}:{line} imports {layer}")
    assert upward == []


def test_an_upward_import_is_caught(tmp_path):
    """Negative control: the same walk finds a planning module importing the connector."""
    root = tmp_path / "xavier"
    fake = root / "planning" / "options.py"
    fake.parent.mkdir(parents=True)
    fake.write_text((PKG / "planning" / "options.py").read_text()
                    + "\nfrom ..vllm_side.connector import XavierConnector\n")
    assert layer_of(fake, root) == "planning"
    assert [layer for _, layer in imported_layers(fake, root)][-1] == "vllm_side"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_public_classes_have_docstrings_and_modules_stay_small(path):
    tree = ast.parse(path.read_text())
    missing = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
               and not n.name.startswith("_") and not ast.get_docstring(n)]
    assert missing == []
    assert len(path.read_text().splitlines()) <= MAX_LINES


def test_every_overridden_connector_method_states_its_contract():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from xinference.model.llm.vllm.xavier.vllm_side.connector import XavierConnector

    overridden = [name for name, member in vars(XavierConnector).items()
                  if callable(member) or isinstance(member, property)
                  if hasattr(KVConnectorBase_V1, name) and not name.startswith("__")]
    assert "get_num_new_matched_tokens" in overridden and "start_load_kv" in overridden
    undocumented = [name for name in overridden
                    if not (getattr(XavierConnector, name).__doc__ or "").strip()]
    assert undocumented == []


def test_production_objects_carry_no_test_hooks():
    """Faults and digest readers live in tests/support (#23): the actor and the worker's
    data plane that a deployment runs have none of them."""
    from tests.support.worker_hooks import WorkerHooks
    from xinference.model.llm.vllm.xavier.transfer import TransferActor
    from xinference.model.llm.vllm.xavier.vllm_side.worker_plane import WorkerDataPlane

    hooks = {n for n in vars(WorkerHooks) if not n.startswith("_")}
    assert {"inject_fault", "raw_load", "stored_block_digests"} <= hooks
    for production in (TransferActor, WorkerDataPlane):
        assert hooks & set(dir(production)) <= {"flush"}, production.__name__


def test_every_module_logs_under_xinferences_logger():
    """A module's logger is named by ``package_logger`` (``xinference.model.llm.vllm.xavier.*``,
    whichever of its two names loaded it): under the installed name
    (``_xinference_xavier_fork.*``) ``logging.getLogger(__name__)`` is outside Xinference's
    ``xinference`` logger, whose handlers write its log, and its lines are lost (the
    router's were, until session 35)."""
    plain = [(p.relative_to(PKG), n) for p in modules()
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"logging\.getLogger\(__name__\)", line)]
    assert plain == []


def file_map() -> dict:
    """The folders' rows of doc/architecture.md's map: folder -> the row's text."""
    doc = (PKG.parents[4] / "doc" / "architecture.md").read_text()
    rows = {}
    for line in doc.splitlines():
        m = re.match(r"\| (root:[^|]*|`(\w+)/`) \| (.*?) \| [^|]* \|$", line)
        if m:
            rows["root" if m.group(1).startswith("root") else m.group(2)] = line
    return rows


def test_the_file_map_names_every_module_and_only_modules():
    """doc/architecture.md's map is the one file map (#38): each folder's row names every
    module of the folder, and every lowercase name outside parentheses in it is one."""
    rows = file_map()
    assert sorted(rows) == sorted(LAYERS)
    for folder, row in rows.items():
        here = PKG if folder == "root" else PKG / folder
        present = {p.stem for p in here.glob("*.py") if p.stem != "__init__"}
        named = set(re.findall(r"`(\w+)`", row))
        assert not present - named, f"{folder}: not in doc/architecture.md's map"
        depth, top = 0, set()
        for token in re.finditer(r"\(|\)|`([^`]+)`", row.split("|")[2]):
            if token.group(0) in "()":
                depth = max(0, depth + (1 if token.group(0) == "(" else -1))
            elif depth == 0 and re.fullmatch(r"[a-z_0-9]+", token.group(1)):
                top.add(token.group(1))
        assert not top - present, f"{folder}: the map names modules that are not there"
