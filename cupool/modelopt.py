"""ModelOpt NVFP4 checkpoints (safetensors) -> NVFP4Tensors -> host-store rows, on the CPU.

Shape legend (DESIGN.md): L layers · E experts · H hidden size · I expert intermediate size.

What a ModelOpt NVFP4 export holds (what this module reads and, for test fixtures, writes):

    <dir>/hf_quant_config.json    {"producer": {...}, "quantization": {"quant_algo": "NVFP4",
                                   "group_size": 16, "kv_cache_quant_algo": ..., "exclude_modules": [...]}}
      or <dir>/config.json        {"quantization_config": {"quant_method": "modelopt",
                                   "quant_algo": "NVFP4", "group_size": 16, "ignore": [...], ...}}
    <dir>/model.safetensors, or shards + model.safetensors.index.json ({"weight_map": {name: file}})

    per expert e of layer l, projection P = gate_proj | up_proj | down_proj (Mixtral: w1 | w3 | w2):
      {prefix}.{e}.{P}.weight          uint8 [N, K/2]   two E2M1 codes a byte, even element low
      {prefix}.{e}.{P}.weight_scale    float8_e4m3fn [N, K/16]
      {prefix}.{e}.{P}.weight_scale_2  float32 [] or [1]  (the global scale)
      {prefix}.{e}.{P}.input_scale     activation scale: not needed for weights, ignored
    with prefix e.g. "model.layers.{l}.mlp.experts" or "model.layers.{l}.block_sparse_moe.experts".
    gate/up are [I, H], down is [H, I] (`F.linear` convention).

These are exactly `NVFP4Tensor`'s fields, so reading is a name lookup plus checks, and rows come
from `cupool.layout` without a GPU. Every problem raises `CheckpointError` naming the tensor or
file and the values involved.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

import torch

from cupool import layout as _layout
from cupool.nvfp4 import BLOCK, NVFP4Tensor

HF_QUANT_CONFIG = "hf_quant_config.json"
INDEX = "model.safetensors.index.json"
# quant_algo values whose weights are stored as above (W4A16 differs only in the activations)
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
SPELLINGS = {"proj": ("gate_proj", "up_proj", "down_proj"), "w": ("w1", "w3", "w2")}
DEFAULT_PREFIX = "model.layers.{layer}.mlp.experts"

_EXPERT_KEY = re.compile(r"^(?P<head>(?:.*\.)?layers\.)(?P<layer>\d+)(?P<tail>\..*?experts)\."
                         r"(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


class CheckpointError(ValueError):
    """A checkpoint that is not a readable ModelOpt NVFP4 export (the message says what and where)."""


# --- config -----------------------------------------------------------------------------------------
def _check_algo(algo, where: str, quant_cfg: dict) -> str:
    if algo is None:
        raise CheckpointError(f"{where}: no quant_algo; expected one of {list(NVFP4_ALGOS)}")
    a = str(algo).upper()
    if a == "MIXED_PRECISION":
        # per-module algorithms: fine when every expert module listed is NVFP4
        layers = quant_cfg.get("quantized_layers") or {}
        algos = {str(v.get("quant_algo", "")).upper() for k, v in layers.items()
                 if "experts" in k and isinstance(v, dict)}
        if algos and algos <= set(NVFP4_ALGOS):
            return a
        raise CheckpointError(f"{where}: quant_algo MIXED_PRECISION with expert modules in "
                              f"{sorted(algos) or 'no listed algorithm'}; cupool reads NVFP4 experts "
                              f"({' or '.join(NVFP4_ALGOS)}) only")
    if a not in NVFP4_ALGOS:
        raise CheckpointError(f"{where}: quant_algo is {algo!r}; cupool reads ModelOpt NVFP4 "
                              f"checkpoints ({' or '.join(NVFP4_ALGOS)}) only")
    return a


def _check_group_size(gs, where: str) -> int:
    if gs is None:
        return BLOCK            # NVFP4 fixes it; older exports leave it out
    if gs != BLOCK:
        raise CheckpointError(f"{where}: group_size is {gs!r}; NVFP4 block scales cover {BLOCK} "
                              f"elements")
    return BLOCK


def read_quant_config(path) -> dict:
    """The quantization config of a checkpoint directory (or of a file's directory), checked.

    Looks for hf_quant_config.json first, then config.json's quantization_config. Returns
    {"quant_algo", "group_size", "source"}; raises CheckpointError for another quant_algo or
    quant_method, a group size other than 16, or when neither file says anything.
    """
    d = Path(path)
    d = d if d.is_dir() else d.parent
    hq = d / HF_QUANT_CONFIG
    if hq.is_file():
        data = _load_json(hq)
        q = data.get("quantization")
        if not isinstance(q, dict):
            raise CheckpointError(f"{hq}: no 'quantization' object (keys: {sorted(data)})")
        return {"quant_algo": _check_algo(q.get("quant_algo"), str(hq), q),
                "group_size": _check_group_size(q.get("group_size"), str(hq)), "source": str(hq)}
    cj = d / "config.json"
    if cj.is_file():
        data = _load_json(cj)
        q = data.get("quantization_config")
        if isinstance(q, dict):
            where = f"{cj} quantization_config"
            method = q.get("quant_method")
            if method is not None and str(method).lower() not in ("modelopt", "modelopt_fp4"):
                raise CheckpointError(f"{where}: quant_method is {method!r}, not a ModelOpt "
                                      f"export ('modelopt'); cupool reads ModelOpt NVFP4 only")
            gs = q.get("group_size")
            if gs is None:
                gs = (q.get("weights") or {}).get("group_size")
            if gs is None:
                for grp in (q.get("config_groups") or {}).values():
                    gs = ((grp or {}).get("weights") or {}).get("group_size", gs)
            return {"quant_algo": _check_algo(q.get("quant_algo"), where, q),
                    "group_size": _check_group_size(gs, where), "source": str(cj)}
    raise CheckpointError(f"{d}: no quantization config: expected {HF_QUANT_CONFIG} or a "
                          f"config.json with quantization_config (pass require_config=False to "
                          f"read the tensors anyway)")


def _load_json(p: Path) -> dict:
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{p}: expected a JSON object, got {type(data).__name__}")
    return data


# --- tensors -------------------------------------------------------------------------------------------
class Checkpoint:
    """The tensors of a safetensors checkpoint (one file, a directory, or a sharded index), opened
    lazily, one handle per file; tensors load on demand as CPU torch tensors."""

    def __init__(self, path, *, require_config: bool = True):
        from safetensors import safe_open  # noqa: PLC0415 (keeps `import cupool` light)
        self._safe_open = safe_open
        p = Path(path)
        if not p.exists():
            raise CheckpointError(f"{p}: no such file or directory")
        self.path = p
        self.config = read_quant_config(p) if require_config else None
        self._handles: dict[Path, object] = {}
        self.file_of: dict[str, Path] = {}
        if p.is_file():
            self._add_file(p)
        elif (p / INDEX).is_file():
            wm = _load_json(p / INDEX).get("weight_map")
            if not isinstance(wm, dict):
                raise CheckpointError(f"{p / INDEX}: no 'weight_map' object")
            for name, fname in wm.items():
                f = p / fname
                if not f.is_file():
                    raise CheckpointError(f"{p / INDEX}: tensor {name!r} is in {fname!r}, which "
                                          f"does not exist in {p}")
                self.file_of[name] = f
        else:
            files = sorted(p.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{p}: no *.safetensors files and no {INDEX}")
            for f in files:
                self._add_file(f)

    def _handle(self, f: Path):
        h = self._handles.get(f)
        if h is None:
            try:
                h = self._safe_open(str(f), framework="pt", device="cpu")
            except Exception as e:  # noqa: BLE001 (safetensors raises several kinds)
                raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
            self._handles[f] = h
        return h

    def _add_file(self, f: Path) -> None:
        for name in self._handle(f).keys():
            self.file_of[name] = f

    def keys(self):
        return self.file_of.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name`; CheckpointError naming it and the closest names present if absent."""
        f = self.file_of.get(name)
        if f is None:
            raise CheckpointError(self._missing(name))
        return self._handle(f).get_tensor(name)

    def similar(self, name: str) -> list[str]:
        """Up to 6 names present that look like `name`."""
        keys = list(self.file_of)
        # candidates sharing the expert's path first: cheaper and more useful than all keys
        stem = name.rsplit(".", 2)[0]
        near = [k for k in keys if k.startswith(stem)] or keys
        return difflib.get_close_matches(name, near, n=6, cutoff=0.5)

    def _missing(self, name: str) -> str:
        return (f"tensor {name!r} is not in the checkpoint {self.path} ({len(self.file_of)} "
                f"tensors); similar names present: {self.similar(name) or 'none'}")

    def expert_prefixes(self) -> dict[str, set[int]]:
        """Name templates of per-expert weights found ("...layers.{layer}....experts") -> layers."""
        found: dict[str, set[int]] = {}
        for name in self.file_of:
            m = _EXPERT_KEY.match(name)
            if m:
                found.setdefault(m["head"] + "{layer}" + m["tail"], set()).add(int(m["layer"]))
        return found

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _open(path_or_ckpt, require_config: bool) -> tuple[Checkpoint, bool]:
    if isinstance(path_or_ckpt, Checkpoint):
        return path_or_ckpt, False
    return Checkpoint(path_or_ckpt, require_config=require_config), True


def _resolve_prefix(ckpt: Checkpoint, prefix: str | None) -> str:
    if prefix is not None:
        if "{layer}" not in prefix:
            raise ValueError(f"prefix must contain '{{layer}}', e.g. {DEFAULT_PREFIX!r}, got "
                             f"{prefix!r}")
        return prefix
    found = ckpt.expert_prefixes()
    if not found:
        sample = sorted(ckpt.keys())[:8]
        raise CheckpointError(f"{ckpt.path}: no per-expert weights named like "
                              f"'...layers.<l>....experts.<e>.(gate_proj|up_proj|down_proj|w1|w3|w2)"
                              f".weight' (first names: {sample}); pass prefix=")
    if len(found) > 1:
        raise CheckpointError(f"{ckpt.path}: expert weights under several name patterns "
                              f"{sorted(found)}; pass prefix= to pick one")
    return next(iter(found))


def _projection_names(ckpt: Checkpoint, base: str) -> tuple[str, str, str]:
    """(gate, up, down) projection names under `base` ("...experts.{e}"), in whichever spelling
    the checkpoint uses."""
    for names in SPELLINGS.values():
        if f"{base}.{names[0]}.weight" in ckpt:
            return names
    raise CheckpointError(f"expert {base!r}: neither {base}.gate_proj.weight nor (Mixtral "
                          f"spelling) {base}.w1.weight is in the checkpoint {ckpt.path} "
                          f"({len(ckpt.file_of)} tensors); similar names present: "
                          f"{ckpt.similar(base + '.gate_proj.weight') or 'none'}")


def _read_matrix(ckpt: Checkpoint, name: str) -> NVFP4Tensor:
    """One projection `name` (without the .weight suffix) -> NVFP4Tensor [N, K], checked."""
    w = ckpt.get(f"{name}.weight")
    s = ckpt.get(f"{name}.weight_scale")
    g = ckpt.get(f"{name}.weight_scale_2")
    if w.dtype != torch.uint8:
        hint = (" (a floating weight: is this module excluded from quantization?)"
                if w.dtype.is_floating_point else "")
        raise CheckpointError(f"{name}.weight: dtype {w.dtype}, expected torch.uint8 (two packed "
                              f"E2M1 codes a byte){hint}")
    if w.dim() != 2 or w.shape[1] * 2 % BLOCK:
        raise CheckpointError(f"{name}.weight: shape {list(w.shape)}, expected 2-D [N, K/2] with K a "
                              f"multiple of {BLOCK}")
    n, k = w.shape[0], w.shape[1] * 2
    if s.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{name}.weight_scale: dtype {s.dtype}, expected torch.float8_e4m3fn")
    if tuple(s.shape) != (n, k // BLOCK):
        raise CheckpointError(f"{name}.weight_scale: shape {list(s.shape)}, expected "
                              f"{[n, k // BLOCK]} (one scale per {BLOCK} elements of "
                              f"{name}.weight [{n}, {k}])")
    if g.dtype != torch.float32:
        raise CheckpointError(f"{name}.weight_scale_2: dtype {g.dtype}, expected torch.float32")
    if g.numel() != 1 or g.dim() > 1:
        raise CheckpointError(f"{name}.weight_scale_2: shape {list(g.shape)}, expected a scalar "
                              f"([] or [1]): one global scale per matrix")
    return NVFP4Tensor(packed=w.contiguous(), block_scale=s.contiguous(),
                       global_scale=g.reshape(()).clone())


def _expect(name: str, q: NVFP4Tensor, shape) -> None:
    if tuple(q.shape) != tuple(shape):
        raise CheckpointError(f"{name}: weight is {list(q.shape)} (unpacked; packed "
                              f"{list(q.packed.shape)}), expected {list(shape)}")


def read_expert(path_or_dir, layer: int, expert: int, prefix: str | None = None, *,
                require_config: bool = True) -> tuple[NVFP4Tensor, NVFP4Tensor, NVFP4Tensor]:
    """(gate [I, H], up [I, H], down [H, I]) NVFP4Tensors of one expert of a ModelOpt checkpoint.

    path_or_dir: a checkpoint directory, one .safetensors file, or an open `Checkpoint`.
    prefix: the experts' name template with "{layer}" (default: found from the tensor names, e.g.
    "model.layers.{layer}.mlp.experts"). Both the gate_proj/up_proj/down_proj and the w1/w3/w2
    spellings are read.
    """
    ckpt, own = _open(path_or_dir, require_config)
    try:
        base = f"{_resolve_prefix(ckpt, prefix).format(layer=layer)}.{expert}"
        names = [f"{base}.{p}" for p in _projection_names(ckpt, base)]
        gate, up, down = (_read_matrix(ckpt, nm) for nm in names)
        i, h = gate.shape
        _expect(f"{names[1]}.weight", up, (i, h))
        _expect(f"{names[2]}.weight", down, (h, i))
        return gate, up, down
    finally:
        if own:
            ckpt.close()


def fill_store_from_checkpoint(store, path, row_layout: _layout.RowLayout, *,
                               prefix: str | None = None, layers=None, progress: bool = True,
                               require_config: bool = True) -> None:
    """Fill every row of `store` (L layers × E experts) from a ModelOpt NVFP4 checkpoint, layer by
    layer with a progress bar, on the CPU (no GPU needed; the store may be pinned or pageable).

    layers: checkpoint layer index of each store layer (default: the checkpoint's MoE layers in
    order; there must be exactly L of them). Store expert e is checkpoint expert e.
    """
    if store.row_bytes != row_layout.row_bytes:
        raise ValueError(f"store rows are {store.row_bytes} bytes but the layout's rows are "
                         f"{row_layout.row_bytes} (H={row_layout.hidden}, I={row_layout.intermediate})")
    H, I = row_layout.hidden, row_layout.intermediate
    with Checkpoint(path, require_config=require_config) as ckpt:
        pre = _resolve_prefix(ckpt, prefix)
        have = sorted(ckpt.expert_prefixes().get(pre, set()))
        if layers is None:
            if len(have) != store.num_layers:
                raise CheckpointError(f"{ckpt.path}: {len(have)} MoE layers under {pre!r} "
                                      f"({have[:8]}{'...' if len(have) > 8 else ''}), but the store "
                                      f"has {store.num_layers}; pass layers=[...]")
            layers = have
        layers = [int(x) for x in layers]
        if len(layers) != store.num_layers:
            raise ValueError(f"layers: {len(layers)} entries for a store of {store.num_layers} layers")

        def make_layer(li: int):
            mats = []
            for e in range(store.num_experts):
                g, u, d = read_expert(ckpt, layers[li], e, pre)
                base = f"{pre.format(layer=layers[li])}.{e}"
                _expect(f"{base} gate", g, (I, H))
                _expect(f"{base} up", u, (I, H))
                _expect(f"{base} down", d, (H, I))
                mats.append((g, u, d))
            stacked = [NVFP4Tensor(torch.stack([m[j].packed for m in mats]),
                                   torch.stack([m[j].block_scale for m in mats]),
                                   torch.stack([m[j].global_scale for m in mats])) for j in range(3)]
            return _layout.pack_rows(row_layout, *stacked)          # [E, row_bytes] uint8, CPU

        store.fill(make_layer, progress=progress, desc="ModelOpt NVFP4 -> host store")


# --- writer (test fixtures, tools) -------------------------------------------------------------------------
def write_checkpoint(path, experts: dict, quant_algo: str = "NVFP4", *, spelling: str = "proj",
                     prefix: str = DEFAULT_PREFIX, shards: int = 1, config: str = "hf_quant",
                     group_size: int = BLOCK, input_scale: bool = True,
                     extra: dict | None = None) -> Path:
    """Write a ModelOpt-style NVFP4 checkpoint directory.

    experts: {(layer, expert): (gate, up, down)} of 2-D NVFP4Tensors with scalar global scales.
    spelling: "proj" (gate_proj/up_proj/down_proj) or "w" (w1/w3/w2). shards > 1 splits the tensors
    over model-0000i-of-0000n.safetensors with a model.safetensors.index.json. config: "hf_quant"
    (hf_quant_config.json), "config_json" (config.json quantization_config), "both" or "none".
    quant_algo / group_size are written as given (to make bad fixtures too). extra: more tensors.
    """
    from safetensors.torch import save_file  # noqa: PLC0415
    if spelling not in SPELLINGS:
        raise ValueError(f"spelling must be one of {sorted(SPELLINGS)}, got {spelling!r}")
    if config not in ("hf_quant", "config_json", "both", "none"):
        raise ValueError(f"config must be 'hf_quant', 'config_json', 'both' or 'none', got {config!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for (layer, e), mats in sorted(experts.items()):
        for proj, q in zip(SPELLINGS[spelling], mats):
            base = f"{prefix.format(layer=layer)}.{e}.{proj}"
            tensors[f"{base}.weight"] = q.packed.detach().cpu().contiguous()
            tensors[f"{base}.weight_scale"] = q.block_scale.detach().cpu().contiguous()
            tensors[f"{base}.weight_scale_2"] = q.global_scale.detach().cpu().float().reshape(())
            if input_scale:
                tensors[f"{base}.input_scale"] = torch.ones((), dtype=torch.float32)
    tensors.update({k: v.detach().cpu().contiguous() for k, v in (extra or {}).items()})
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        per = -(-len(names) // shards)
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[i * per:(i + 1) * per]}
            save_file(part, str(d / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (d / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                           "weight_map": weight_map}, indent=1))
    if config in ("hf_quant", "both"):
        (d / HF_QUANT_CONFIG).write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "cupool-fixture"},
            "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": None,
                             "group_size": group_size, "exclude_modules": ["lm_head"]}}, indent=1))
    if config in ("config_json", "both"):
        (d / "config.json").write_text(json.dumps({
            "model_type": "cupool-fixture",
            "quantization_config": {"quant_method": "modelopt", "quant_algo": quant_algo,
                                    "group_size": group_size, "ignore": ["lm_head"]}}, indent=1))
    return d

