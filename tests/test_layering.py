"""The layering rule of ARCHITECTURE.md's module map: a cupool module imports cupool modules of its
own layer or below only (checked from the source, imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "cupool"

# module (or package prefix) -> layer, as ARCHITECTURE.md lists them
LAYERS = {
    "cupool._cuda": 0, "cupool._env": 0, "cupool.kernels": 0, "cupool.rawkernels": 0,
    "cupool.nvfp4": 1, "cupool.layout": 1, "cupool.dense_nvfp4": 1, "cupool.store": 1, "cupool.budget": 1,
    "cupool.trace": 1, "cupool.activation": 1, "cupool.estimate": 1, "cupool.hosttable": 1,
    "cupool.reference": 2, "cupool.ops": 2, "cupool.hostexperts": 2,
    "cupool.bank": 3, "cupool.gemm": 3,
    "cupool.adapters": 4, "cupool.layer": 4, "cupool.swap": 4, "cupool.pool": 4,
    "cupool.wrap": 4, "cupool.simulate": 4, "cupool.replay": 4, "cupool.placement": 4,
    "cupool.prefetch": 4,
    "cupool.checkpoints": 3, "cupool.pretrained": 5,
    "cupool.kvcache": 6, "cupool.sampling": 6, "cupool.engine": 6, "cupool.fused": 6,
    "cupool.slotstate": 6, "cupool.graphsafe": 6, "cupool.prefix": 6,
    "cupool.serve": 7, "cupool.cli": 7, "cupool.__main__": 7, "cupool.synthetic": 7,
    "cupool": 7,                                       # the package's __init__: the public API
}


def layer_of(module: str) -> int:
    best = None
    for name, layer in LAYERS.items():
        if module == name or module.startswith(name + "."):
            if best is None or len(name) > len(best[0]):
                best = (name, layer)
    assert best is not None, f"{module} is in no layer of ARCHITECTURE.md's module map"
    return best[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "cupool"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "cupool":
                # `from cupool import x` imports the submodule x where there is one
                subs = [f"{node.module}.{a.name}" for a in node.names]
                out |= {s for s in subs if _exists(s)} or {node.module}
    return out


def _exists(module: str) -> bool:
    p = PKG.parent / Path(*module.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def test_every_module_imports_only_its_layer_or_below():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        mod = module_name(path)
        own = layer_of(mod)
        for dep in imports(path):
            if dep == mod or dep.startswith(mod + "."):
                continue
            if layer_of(dep) > own:
                bad.append(f"{mod} (layer {own}) imports {dep} (layer {layer_of(dep)})")
    assert not bad, "\n".join(bad)


def test_the_map_names_every_module():
    for path in PKG.rglob("*.py"):
        layer_of(module_name(path))
