"""launch.py, and the shape it keeps: every module may import it because it
imports none of them, and the project's imports run one way."""
import ast
import glob
import os
import subprocess
import sys

from conftest import ROOT

MODULES = sorted(os.path.basename(f)[:-3] for f in glob.glob(os.path.join(ROOT, "*.py")))


def project_imports(module: str) -> set[str]:
    """The project modules `module` imports anywhere in its source (top level,
    inside functions, or under TYPE_CHECKING: a circle is a circle)."""
    tree = ast.parse(open(os.path.join(ROOT, module + ".py")).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & set(MODULES) - {module}


def test_the_import_graph_has_no_circle():
    graph = {m: project_imports(m) for m in MODULES}
    order = []
    while graph:
        leaves = sorted(m for m, deps in graph.items() if not deps - set(order))
        assert leaves, f"a circle among {sorted(graph)}: {graph}"
        order += leaves
        graph = {m: deps for m, deps in graph.items() if m not in leaves}
    assert order[0] == "launch" and project_imports("launch") == set()


def modules_loaded_by(imports: str) -> set[str]:
    """Every module a fresh interpreter holds after `import IMPORTS`."""
    return set(subprocess.run([sys.executable, "-c", f"import sys, {imports}; print(' '.join(sys.modules))"],
                              cwd=ROOT, capture_output=True, text=True, check=True).stdout.split())


def test_preparing_data_loads_no_model_code():
    loaded = modules_loaded_by("prepare")
    assert not {"gpt", "kernels", "parallel", "pipeline", "checkpoint", "config", "train", "zero"} & loaded


def test_only_torch_dist_imports_pytorchs_distributed_checkpoint():
    """torch.distributed.checkpoint (DTensor's tables with it: about a second of
    every rank's start) is imported by the torch_dist functions when they run,
    not by train.py or evaluate.py."""
    loaded = modules_loaded_by("train, evaluate")
    assert "checkpoint" in loaded and "torch.distributed.checkpoint" not in loaded
