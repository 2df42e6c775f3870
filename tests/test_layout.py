"""The package's shape: no import circle inside prmppo, and the stage table in one place.

Imports are read from the source with `ast` (module-level and function-level alike), so a circle
held together by an import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """module -> the prmppo modules it imports (a `from pkg import name` of a submodule counts as that module)."""
    modules = {_module_name(p, src): p for p in src.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    kept = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(kept + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_circle_inside_prmppo():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_circle_held_by_a_function_level_import(tmp_path):
    pkg = tmp_path / "prmppo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from prmppo import b\n")
    (pkg / "b.py").write_text("def f():\n    from prmppo.a import thing\n")
    (pkg / "c.py").write_text("import prmppo.a\n")
    assert find_cycle(import_graph(tmp_path)) == ["prmppo.a", "prmppo.b", "prmppo.a"]


def test_every_stage_is_a_module_with_run_and_the_table_lists_them():
    from prmppo.stages import STAGES
    from prmppo.stages import band, eval as eval_stage, pipeline, ppo, prm, sft

    assert STAGES == {"sft": sft.run, "prm": prm.run, "band": band.run, "ppo": ppo.run, "eval": eval_stage.run,
                      "pipeline": pipeline.run}
    for module in (sft, prm, band, ppo):  # the stages that make an artifact others reuse
        assert callable(getattr(module, {"sft": "ensure_sft", "prm": "ensure_prm", "band": "ensure_band",
                                         "ppo": "train_ppo"}[
            module.__name__.rpartition(".")[2]]))
