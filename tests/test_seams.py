"""Structural promises of the code base that no runtime test would notice breaking."""
import importlib.util
import re

from conftest import REPO

PRIVATE_GROUPS = re.compile(r"group\.WORLD|distributed_c10d|_new_process_group_helper|new_group\(")


def test_process_groups_only_come_from_parallel_dims():
    owner = REPO / "slime/distributed/parallel_dims.py"
    offenders = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
                 for path in sorted((REPO / "slime").rglob("*.py")) + [REPO / "run.py"] if path != owner
                 for n, line in enumerate(path.read_text().splitlines(), 1) if PRIVATE_GROUPS.search(line)]
    assert not offenders, "process groups outside ParallelDims:\n" + "\n".join(offenders)
    assert PRIVATE_GROUPS.search(owner.read_text())  # the pattern does find them where they live


def test_top_level_tool_folders_install_inside_the_slime_namespace():
    for name, folder in (("slime.multimodal", "multimodal"), ("slime.data_tools", "data_tools")):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin == str(REPO / folder / "__init__.py"), name
    setup = (REPO / "setup.py").read_text()
    assert '"data_tools"' not in setup.split("package_dir")[0]  # not listed as top-level packages
