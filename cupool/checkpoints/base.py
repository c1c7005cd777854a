"""The checkpoint interface every format reader implements, and what they share.

Shape legend: L MoE layers · E routed experts per layer · H hidden size · I expert intermediate
size. Projections follow `F.linear` (a weight is [N, K], K the reduction dim): gate (w1) and up
(w3) are [I, H], down (w2) is [H, I]; a stack of n experts puts n first.

How a checkpoint names its routed experts (all found from the tensor names, never guessed):

    per expert   {head}{l}.{mid}.{e}.{proj}.{suffix}       e.g. model.layers.3.mlp.experts.7.gate_proj.weight
                 {head}{l}.{mid}.{proj}.{e}.{suffix}       (the proj-first order some exports use)
                 proj: gate_proj | up_proj | down_proj, or Mixtral's w1 | w3 | w2
    fused        {head}{l}.{mid}.gate_up_proj{suffix}      [E, 2I, H] gate rows first (transformers >= 5)
                 {head}{l}.{mid}.down_proj{suffix}         [E, H, I]
                 or transposed, as Llama-4 and gpt-oss hold them: gate_up [E, H, 2I], down [E, I, H]
    head: e.g. "model.layers.", "model.language_model.layers.", "backbone.layers.", "mtp.layers.";
    mid ends with the component "experts" ("mlp.experts", "block_sparse_moe.experts",
    "feed_forward.experts", Nemotron-H's "mixer.experts"), so shared experts
    ("mlp.shared_experts", "mlp.shared_expert", "mixer.shared_experts") are dense tensors.

Experts without a gate projection (Nemotron-H: down(relu²(up·x))) have up_proj and down_proj
alone, per expert (`backbone.layers.{l}.mixer.experts.{e}.up_proj.weight`, as NVIDIA publishes
them and transformers saves them); whether a checkpoint's experts have a gate is one rule from
config.json, never inferred from the names: **non-gated** when its model_type is "nemotron_h",
gated for every other model type. `Experts.gate` is then None, `Checkpoint.gated` False, and their
rows are `RowLayout(gated=False)`. Fused stacks of such experts and non-gated experts with biases
are refused.

Expert biases (gpt-oss) are read where the checkpoint has them: fused `{mid}.gate_up_proj_bias`
[E, 2I] (laid out like gate_up's 2I rows) and `{mid}.down_proj_bias` [E, H], or per expert
`{proj}.bias` [I] / [H] on all three projections; `Experts.bias` gives them as float32 (gate
[n, I], up [n, I], down [n, H]). A layer has biases on every projection or on none, and every
MoE layer agrees (`Checkpoint.has_bias`).

How gate and up share a fused gate_up (weights, MXFP4 blocks and scales, biases alike), one rule
from config.json, never inferred from the values: **interleaved** (row or column 2i is gate i,
2i + 1 is up i) when config.json's model_type (top level or text sub-config) is "gpt_oss", whose
transformers experts module declares is_concatenated=False; **gate first** (rows [0, I) gate,
[I, 2I) up) for every other model type. Whether a stack is transposed follows from the shapes:
[E, 2I, H] + [E, H, I] or [E, H, 2I] + [E, I, H] (never both, as 2I != I).

Layer indices are the checkpoint's own. Multi-token-prediction (MTP) layers, `mtp.*` names or
`{head}{L + k}` beyond config.json's num_hidden_layers L (for Nemotron-H, whose config may give
only its layer list, the length of hybrid_override_pattern or layers_block_type), are left out
unless include_mtp; then `mtp.layers.{k}` is layer L + k (vLLM's numbering).

The experts' H is their input size: config.json's moe_latent_size where it is set (Nemotron-H's
latent MoE, whose experts compute in a smaller space between the block's own fc1/fc2 latent
projections), else hidden_size.

Expert kinds: float (the checkpoint's bf16/fp16/fp32 tensors, returned as stored) or NVFP4 in
ModelOpt's convention, as stored or converted from MXFP4 (`cupool.checkpoints.mxfp4`):
`NVFP4Tensor` with packed uint8 [n, N, K/2], even element in the low nibble; block_scale
float8_e4m3fn [n, N, K/16]; global_scale float32 [n]; value = e2m1 · block_scale ·
global_scale. Every NVFP4 window is checked before it is returned: block scales finite and >= 0,
global scales finite and > 0 (0 only for an all-zero matrix, whose block scales are all 0, as
`cupool.nvfp4.quantize` writes it), and the largest weight the scales can express,
6 · max(block_scale) · global_scale, at most MAX_IMPLIED_WEIGHT = 1e4. In ModelOpt's convention
that implied value is the matrix's amax, and trained Linear weights are orders of magnitude below
1e4 (typically |w| < 1, rare outliers in the tens); a global scale stored as its reciprocal
(2688 / amax instead of amax / 2688) implies 6 · 448 · 2688 / amax ≈ 7.2e6 / amax, above 1e4 for
every amax below 720, so the bound tells the two conventions apart for any real weight.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from pathlib import Path

import torch

from cupool import nvfp4
from cupool.checkpoints.errors import CheckpointError
from cupool.checkpoints.index import TensorIndex, TensorInfo
from cupool.layout import RowLayout, dense_strips_bytes
from cupool.nvfp4 import BLOCK, NVFP4Tensor

MAX_IMPLIED_WEIGHT = 1e4
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SPELLINGS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
FUSED_PROJS = ("gate_up_proj", "down_proj")
# names of config.json values, in the order they are looked up (top level, then text_config...)
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
HIDDEN_KEYS = ("moe_latent_size", "hidden_size")        # the experts' input size (docstring)
INTERMEDIATE_KEYS = ("moe_intermediate_size", "intermediate_size")
SUBCONFIGS = ("text_config", "language_config", "llm_config")
# model types whose fused gate_up interleaves gate and up (module docstring: the one rule)
INTERLEAVED_MODEL_TYPES = ("gpt_oss",)
# model types whose experts have no gate projection: down(act(up·x)) (module docstring)
NONGATED_MODEL_TYPES = ("nemotron_h",)
NONGATED_SPELLING = (None, "up_proj", "down_proj")
# Nemotron-H's layer lists: the MoE layers are the "E"s of hybrid_override_pattern, or the
# "moe"s of layers_block_type (transformers >= 5 writes the list; releases give either)
PATTERN_KEY, BLOCKS_KEY = "hybrid_override_pattern", "layers_block_type"
# model types whose every decoder layer is an MoE layer (config.json says no more)
ALL_MOE_MODEL_TYPES = ("mixtral", "olmoe", "gpt_oss")
# suffixes of a quantized dense Linear that fold into its `.weight`; KV-cache scales of a
# quantized checkpoint are dropped too (cupool runs attention in the dtype asked for)
ACTIVATION_SCALES = ("input_scale", "input_global_scale", "output_scale")
KV_SCALES = ("k_scale", "v_scale", "q_scale", "prob_scale")

_PROJ = r"gate_proj|up_proj|down_proj|w1|w3|w2"
_HEAD = r"(?P<head>(?:[^.]+\.)+?)(?P<layer>\d+)\.(?P<mid>(?:[^.]+\.)*?experts)\."
_PER_EXPERT = re.compile(rf"^{_HEAD}(?:(?P<e1>\d+)\.(?P<p1>{_PROJ})|(?P<p2>{_PROJ})\.(?P<e2>\d+))"
                         r"\.(?P<suffix>[A-Za-z0-9_]+)$")
# up_proj: a fused stack of non-gated experts (recognised so that it can be refused by name)
_FUSED = re.compile(rf"^{_HEAD}(?P<proj>gate_up_proj|up_proj|down_proj)"
                    r"(?P<suffix>(?:_[A-Za-z0-9_]+)?(?:\.[A-Za-z0-9_]+)?)$")
# Fused experts stored under other names, read as the fused names they stand for (transformers'
# own renames): Granite's (GraniteMoe, Granite-4) block_sparse_moe.input_linear [E, 2I, H], gate
# rows first, and output_linear [E, H, I].
FUSED_ALIASES = ((re.compile(r"\.block_sparse_moe\.input_linear(?=[._])"),
                  ".block_sparse_moe.experts.gate_up_proj"),
                 (re.compile(r"\.block_sparse_moe\.output_linear(?=[._])"),
                  ".block_sparse_moe.experts.down_proj"))


def fused_alias(name: str) -> str:
    """`name` with a FUSED_ALIASES rename applied (unchanged where none applies)."""
    for pat, rep in FUSED_ALIASES:
        name = pat.sub(rep, name, count=1)
    return name


class ExpertKind(enum.Enum):
    """What `Checkpoint.experts` returns: the stored float tensors, or NVFP4Tensors."""
    FLOAT = "float"
    NVFP4 = "nvfp4"


@dataclasses.dataclass
class Experts:
    """Experts [start, stop) of one layer, n = stop - start.

    kind FLOAT: gate, up [n, I, H] and down [n, H, I] in the checkpoint's dtype (bf16, fp16 or
    fp32; gate and up may be views of one [n, 2I, H] buffer). kind NVFP4: three stacked
    `NVFP4Tensor`s of those logical shapes in ModelOpt's convention (see the module docstring).
    gate is None for experts without a gate projection (Nemotron-H). bias: None, or float32 (gate
    [n, I], up [n, I], down [n, H]) for experts with biases, gate and up taken apart like the
    weights.
    """
    kind: ExpertKind
    layer: int
    start: int
    stop: int
    gate: torch.Tensor | NVFP4Tensor | None
    up: torch.Tensor | NVFP4Tensor
    down: torch.Tensor | NVFP4Tensor
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def n(self) -> int:
        return self.stop - self.start

    def nvfp4(self) -> tuple[NVFP4Tensor | None, NVFP4Tensor, NVFP4Tensor]:
        """(gate, up, down) as NVFP4Tensors: as read for NVFP4 experts; float ones quantized by the
        CPU reference `cupool.nvfp4.quantize`, one global scale per matrix (ModelOpt's w1, w3,
        w2); gate None for non-gated experts. CheckpointError naming the layer and experts for
        NaN/Inf weights."""
        if self.kind is ExpertKind.NVFP4:
            return self.gate, self.up, self.down
        out = []
        for proj, w in zip(("gate", "up", "down"), (self.gate, self.up, self.down)):
            if w is None:
                out.append(None)
                continue
            try:
                out.append(nvfp4.quantize(w))
            except ValueError as e:
                raise CheckpointError(f"layer {self.layer}, experts [{self.start}, {self.stop}), "
                                      f"{proj}: {e}") from None
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class ExpertSizes:
    """The routed experts' sizes in bytes, for planning from headers alone.

    With m = 3 matrices an expert (gate, up, down; 2 for experts without a gate): codes =
    L·E·m·H·I / 2 (E2M1 codes, two a byte), block_scales = L·E·m·H·I / 16 (one e4m3 per 16),
    global_scales = L·E·m·4, biases = L·E·(2I + H)·4 (float32, 0 without biases); row_bytes =
    RowLayout(H, I, bias=has_bias, gated=gated).row_bytes (one expert in the store, padding to
    64 and biases included), store_bytes = L·E·row_stride (rows at `align`-byte strides, as
    HostStore places them); checkpoint_bytes: what the expert tensors occupy in the files.
    """
    layers: int
    experts: int
    hidden: int
    intermediate: int
    codes: int
    block_scales: int
    global_scales: int
    biases: int
    row_bytes: int
    store_bytes: int
    checkpoint_bytes: int

    @property
    def nvfp4_bytes(self) -> int:
        return self.codes + self.block_scales + self.global_scales


@dataclasses.dataclass(frozen=True)
class NVFP4Naming:
    """How a format names an NVFP4 Linear's tensors: the leaves after `{module}.` (per-expert and
    dense Linears; fused experts `{mid}.gate_up_proj{_leaf}` use the same leaves, the weight's
    being the bare name)."""
    weight: str
    block_scale: str
    global_scale: str
    reciprocal: bool             # global scale stored as 1 / (ModelOpt's weight_scale_2)
    hint: str                    # what an implausible global scale suggests


@dataclasses.dataclass
class _Group:
    """One layer's routed-expert tensors as named: per-expert or fused components."""
    head: str
    num: int
    mid: str
    per: dict = dataclasses.field(default_factory=dict)     # (e, proj) -> {suffix: TensorInfo}
    order: set = dataclasses.field(default_factory=set)     # "ep" / "pe"
    fused: dict = dataclasses.field(default_factory=dict)   # proj -> {suffix: TensorInfo}

    @property
    def base(self) -> str:
        return f"{self.head}{self.num}.{self.mid}"

    def names(self) -> list[str]:
        out = [i.name for c in self.per.values() for i in c.values()]
        return out + [i.name for c in self.fused.values() for i in c.values()]


@dataclasses.dataclass
class _Layer:
    """How to read one layer's experts (built from headers at open)."""
    index: int
    group: _Group
    kind: ExpertKind
    dtype: torch.dtype | None             # float experts
    experts: int
    hidden: int
    intermediate: int
    per: list | None = None               # [proj][e] -> {"w"|"s"|"g": TensorInfo}; [0] None
                                          # for non-gated experts
    fused: tuple | None = None            # (gate_up roles, down roles)
    transposed: tuple = (False, False)
    global_mode: tuple = ("expert", "expert")    # fused NVFP4: shared | expert | expert_half
    bias: bool = False                    # roles carry "b" (the bias TensorInfo) on every matrix
    interleaved: bool = False             # fused gate_up: gate/up interleaved (module docstring)
    source: str = "stored"                # "stored" (read as is) | "mxfp4" (converted)
    gated: bool = True                    # False: up and down alone (NONGATED_MODEL_TYPES)


@dataclasses.dataclass(frozen=True)
class _Dense:
    kind: str                              # "plain" | "nvfp4" | "fp8"
    name: str                              # the name dense_names() reports
    roles: dict                            # role -> TensorInfo
    shape: tuple[int, ...]                 # logical (dequantized) shape


def config_value(config: dict, keys) -> tuple[str | None, object]:
    """(where, value) of the first of `keys` set in config.json, at the top level or in a text
    sub-config (multimodal checkpoints keep the language model's values in text_config)."""
    scopes = [("", config)] + [(f"{k}.", config.get(k)) for k in SUBCONFIGS]
    for prefix, c in scopes:
        if isinstance(c, dict):
            for k in keys:
                if c.get(k) is not None:
                    return prefix + k, c[k]
    return None, None


def _sub(config: dict) -> dict:
    """The sub-config holding the MoE layout keys (text_config where there is one)."""
    for k in SUBCONFIGS:
        if isinstance(config.get(k), dict) and "num_hidden_layers" in config[k]:
            return config[k]
    return config


def layer_list(config: dict) -> tuple[str, list[str]] | None:
    """(key, one type a layer) of a Nemotron-H config's layer list: hybrid_override_pattern's
    characters ("M" Mamba, "E" MoE, "*" attention, "-" MLP) or layers_block_type's entries
    ("mamba" / "linear_attention", "moe", "attention" / "full_attention", "mlp"), the MoE layers
    as "moe" either way; None where the config has neither."""
    c = _sub(config)
    pattern = c.get(PATTERN_KEY)
    if isinstance(pattern, str) and pattern:
        return PATTERN_KEY, ["moe" if ch == "E" else ch for ch in pattern]
    blocks = c.get(BLOCKS_KEY)
    if isinstance(blocks, list) and blocks:
        return BLOCKS_KEY, [str(b) for b in blocks]
    return None


def num_layers(config: dict) -> tuple[str | None, int | None]:
    """(where, L): config.json's num_hidden_layers, or the length of a Nemotron-H layer list
    where num_hidden_layers is absent (transformers >= 5 writes the list alone)."""
    where, L = config_value(config, ("num_hidden_layers",))
    if L is not None:
        return where, int(L)
    found = layer_list(config)
    if found is not None:
        return f"len({found[0]})", len(found[1])
    return None, None


def expected_moe_layers(config: dict, num_layers: int) -> tuple[set[int], str] | None:
    """The MoE layers config.json implies, with the keys that say so; None where it does not say
    (first_k_dense_replace/moe_layer_freq: DeepSeek, GLM; mlp_only_layers/decoder_sparse_step:
    Qwen; interleave_moe_layer_step / moe_layers: Llama-4; hybrid_override_pattern /
    layers_block_type: Nemotron-H; Mixtral and OLMoE: every layer)."""
    c = _sub(config)
    L = num_layers
    found = layer_list(config)
    if found is not None:
        key, types = found
        shown = c[key] if key == PATTERN_KEY else f"[{len(types)} entries]"
        return {i for i, t in enumerate(types) if t == "moe"}, f"{key}={shown}"
    if isinstance(c.get("moe_layers"), list):
        return {int(i) for i in c["moe_layers"]}, "moe_layers"
    if c.get("first_k_dense_replace") is not None:
        k, freq = int(c["first_k_dense_replace"]), int(c.get("moe_layer_freq") or 1)
        return {i for i in range(L) if i >= k and i % freq == 0}, \
            f"first_k_dense_replace={k}, moe_layer_freq={freq}"
    if c.get("decoder_sparse_step") is not None or c.get("mlp_only_layers") is not None:
        step = int(c.get("decoder_sparse_step") or 1)
        only = {int(i) for i in c.get("mlp_only_layers") or []}
        return {i for i in range(L) if i not in only and (i + 1) % step == 0}, \
            f"decoder_sparse_step={step}, mlp_only_layers={sorted(only)}"
    if c.get("interleave_moe_layer_step") is not None:
        step = int(c["interleave_moe_layer_step"])
        return {i for i in range(L) if step > 0 and (i + 1) % step == 0}, \
            f"interleave_moe_layer_step={step}"
    if model_type(config) in ALL_MOE_MODEL_TYPES:
        return set(range(L)), f"model_type={model_type(config)!r}"
    return None


def model_type(config: dict) -> str | None:
    """config.json's model_type: the text sub-config's where it has one, else the top level's."""
    return _sub(config).get("model_type", config.get("model_type"))


def split_gate_up(t: torch.Tensor, interleaved: bool, dim: int = 1):
    """(gate, up) views of a fused gate_up stack whose dim `dim` is 2I long: rows 2i and 2i + 1
    when interleaved, else [0, I) and [I, 2I) (module docstring)."""
    n2 = t.shape[dim]
    if interleaved:
        pairs = t.unflatten(dim, (n2 // 2, 2))
        return pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)
    return t.narrow(dim, 0, n2 // 2), t.narrow(dim, n2 // 2, n2 // 2)


def join_gate_up(gate: torch.Tensor, up: torch.Tensor, interleaved: bool,
                 dim: int = 1) -> torch.Tensor:
    """Inverse of `split_gate_up`: the fused stack (a new tensor) whose dim `dim` is 2I long."""
    if interleaved:
        return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)
    return torch.cat([gate, up], dim=dim)


def gate_up_rows(interleaved: bool, I: int) -> tuple[str, str]:
    """How the gate and up halves of a fused gate_up are named in messages."""
    if interleaved:
        return "rows 0::2 (gate)", "rows 1::2 (up)"
    return f"rows [0, {I})", f"rows [{I}, {2 * I})"


def _is_mtp_head(head: str) -> bool:
    return any(part.startswith("mtp") for part in head.split("."))


def _short(xs, n: int = 8) -> str:
    xs = list(xs)
    return f"{xs[:n]}{' ...' if len(xs) > n else ''}"


def check_nvfp4(q: NVFP4Tensor, s_label, g_label, hint: str) -> None:
    """CheckpointError unless every matrix of a stack (q.block_scale [n, N, K/16], q.global_scale
    [n]) has plausible scales (module docstring); s_label(i) / g_label(i) name matrix i's block
    and global scale tensors in the message."""
    s = q.block_scale.float()
    n = s.shape[0]
    flat = s.reshape(n, -1)
    bad = torch.isnan(flat) | (flat < 0)
    if bool(bad.any()):
        i, j = (int(x) for x in torch.nonzero(bad)[0])
        v = float(flat[i, j])
        what = "NaN" if math.isnan(v) else "negative"
        raise CheckpointError(f"{s_label(i)}: block scale {v} at {nvfp4.unravel(j, s.shape[1:])} is "
                              f"{what}; NVFP4 block scales are finite and >= 0")
    g = q.global_scale.float().reshape(n)
    bad = ~torch.isfinite(g) | (g < 0)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise CheckpointError(f"{g_label(i)}: global scale {float(g[i])}; NVFP4 global scales "
                              f"are finite and > 0")
    smax = flat.amax(dim=1) if flat.shape[1] else torch.zeros(n)
    bad = (g == 0) & (smax > 0)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise CheckpointError(f"{g_label(i)}: global scale 0 with block scales up to "
                              f"{float(smax[i])}: every weight would dequantize to 0; a global "
                              f"scale is > 0 (0 only for an all-zero matrix)")
    implied = 6.0 * smax.double() * g.double()
    bad = implied > MAX_IMPLIED_WEIGHT
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise CheckpointError(f"{g_label(i)}: global scale {float(g[i]):.6g} with block scales up "
                              f"to {float(smax[i]):g} implies weights up to 6 · "
                              f"{float(smax[i]):g} · {float(g[i]):.6g} = {float(implied[i]):.4g} "
                              f"> {MAX_IMPLIED_WEIGHT:g}, far beyond any trained weight; {hint}")


def _expand_blocks(s: torch.Tensor, n: int, k: int, bn: int, bk: int) -> torch.Tensor:
    return s.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


class Checkpoint:
    """A checkpoint directory opened from config.json and the safetensors headers.

    Attributes: path, config (config.json as a dict), format ("float", "modelopt-nvfp4",
    "compressed-tensors-nvfp4", "mxfp4"), include_mtp, index (`TensorIndex`), moe_layers
    (checkpoint layer indices with routed experts, in order), num_experts E, hidden H,
    intermediate I, each checked against config.json where it gives them; has_bias (the experts
    have biases, every MoE layer alike); gated (False for experts without a gate projection,
    Nemotron-H's: `Experts.gate` is None; module docstring); conversion (None, or the running
    tally of what reading converted, `cupool.checkpoints.mxfp4.ConversionTally`, for formats read
    by conversion).

    Reads data only in `experts`, `dense_tensor`, `dense_nvfp4` and `read_experts`-style
    callers; `close()` (or a `with` block) closes the files.
    """
    format = "?"
    naming: NVFP4Naming | None = None
    conversion = None
    reads_fp8_experts = False      # block-scaled FP8 experts dequantized (`checkpoints.fp8`)

    def __init__(self, path, index: TensorIndex, config: dict, quant=None, *,
                 include_mtp: bool = False):
        self.path = Path(path)
        self.index = index
        self.config = config
        self.quant = quant
        self.include_mtp = bool(include_mtp)
        self._scan()

    # --- format hooks --------------------------------------------------------------------------
    def declared(self, modules: list[str]) -> tuple[str, str] | None:
        """(kind, source) the quantization config gives for a module (any of `modules`, the names
        it may be listed under): kind "float" (excluded/ignored), "nvfp4" or another algorithm;
        None where the config says nothing about it."""
        return None

    def fp8_block(self) -> tuple[int, int] | None:
        """The FP8 block size the config states, if any."""
        return None

    # --- scanning ----------------------------------------------------------------------------
    def _scan(self) -> None:
        groups: dict[tuple, _Group] = {}
        self._expert_names: set[str] = set()
        for name, info in self.index.infos.items():
            m = _PER_EXPERT.match(name)
            if m:
                g = groups.setdefault((m["head"], int(m["layer"]), m["mid"]),
                                      _Group(m["head"], int(m["layer"]), m["mid"]))
                if m["e1"] is not None:
                    e, proj, order = int(m["e1"]), m["p1"], "ep"
                else:
                    e, proj, order = int(m["e2"]), m["p2"], "pe"
                g.per.setdefault((e, proj), {})[m["suffix"]] = info
                g.order.add(order)
                self._expert_names.add(name)
                continue
            m = _FUSED.match(fused_alias(name))
            if m:
                g = groups.setdefault((m["head"], int(m["layer"]), m["mid"]),
                                      _Group(m["head"], int(m["layer"]), m["mid"]))
                g.fused.setdefault(m["proj"], {})[_fused_suffix(m["suffix"])] = info
                self._expert_names.add(name)
        if not groups:
            raise CheckpointError(
                f"{self.path}: no routed-expert tensors (names like "
                f"'model.layers.<l>.mlp.experts.<e>.gate_proj.weight', '...experts.<e>.w1.weight' "
                f"or '...experts.gate_up_proj'); first names: {_short(self.index.names(), 6)}")
        _, L = num_layers(self.config)
        self.num_hidden_layers = L
        heads = sorted({h for (h, _, _) in groups if not _is_mtp_head(h)})
        if len(heads) != 1:
            raise CheckpointError(f"{self.path}: routed experts under "
                                  f"{'no' if not heads else len(heads)} layer stacks "
                                  f"{heads or sorted({h for (h, _, _) in groups})}; expected one "
                                  f"main stack (and optionally an mtp.* one)")
        self.main_head = heads[0]
        layers: dict[int, _Group] = {}
        mtp: list[int] = []
        for (head, num, _), g in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            if head == self.main_head:
                idx, is_mtp = num, (self.num_hidden_layers is not None
                                    and num >= self.num_hidden_layers)
            else:
                if self.num_hidden_layers is None:
                    if not self.include_mtp:
                        continue
                    raise CheckpointError(f"{self.path}/config.json has no num_hidden_layers, so "
                                          f"the MTP layer {g.base} cannot be numbered")
                idx, is_mtp = self.num_hidden_layers + num, True
            if is_mtp:
                mtp.append(idx)
                if not self.include_mtp:
                    continue
            if idx in layers:
                raise CheckpointError(f"layer {idx}: experts under both {layers[idx].base} and "
                                      f"{g.base}")
            layers[idx] = g
        self.mtp_layers = sorted(mtp)
        if not layers:
            raise CheckpointError(f"{self.path}: routed experts only in MTP layers {mtp}; pass "
                                  f"include_mtp=True to read them")
        main = {i for i in layers if i not in mtp}
        exp = (expected_moe_layers(self.config, self.num_hidden_layers)
               if self.num_hidden_layers is not None else None)
        if exp is not None and exp[0] != main:
            want, why = exp
            raise CheckpointError(
                f"{self.path}/config.json ({why}, num_hidden_layers={self.num_hidden_layers}) "
                f"makes layers {_short(sorted(want), 12)} MoE layers, but routed experts are under "
                f"layers {_short(sorted(main), 12)}: missing {sorted(want - main)}, unexpected "
                f"{sorted(main - want)}")
        self._layers: dict[int, _Layer] = {}
        first: _Layer | None = None
        for idx in sorted(layers):
            spec = self._layer_spec(idx, layers[idx])
            if first is None:
                first = spec
            elif (spec.experts, spec.hidden, spec.intermediate) != \
                    (first.experts, first.hidden, first.intermediate):
                raise CheckpointError(
                    f"layers disagree on their experts' shapes: layer {idx} ({spec.group.base}) "
                    f"has E={spec.experts}, H={spec.hidden}, I={spec.intermediate}, layer "
                    f"{first.index} ({first.group.base}) has E={first.experts}, "
                    f"H={first.hidden}, I={first.intermediate}")
            self._layers[idx] = spec
        self.moe_layers = sorted(self._layers)
        self.num_experts, self.hidden, self.intermediate = \
            first.experts, first.hidden, first.intermediate
        other = next((s for s in self._layers.values() if s.bias != first.bias), None)
        if other is not None:
            a, b = (first, other) if first.bias else (other, first)
            raise CheckpointError(f"layers disagree on expert biases: layer {a.index} "
                                  f"({a.group.base}) has them, layer {b.index} ({b.group.base}) "
                                  f"has none; one row layout serves every MoE layer")
        self.has_bias = first.bias
        self.gated = first.gated           # one rule for every layer (module docstring)
        if any(sp.source == "fp8" for sp in self._layers.values()):
            from cupool.checkpoints.fp8 import Fp8Tally
            self.format = "fp8"
            self.conversion = Fp8Tally()
        for keys, val, what in ((EXPERT_KEYS, self.num_experts, "E"),
                                (HIDDEN_KEYS, self.hidden, "H"),
                                (INTERMEDIATE_KEYS, self.intermediate, "I")):
            where, cv = config_value(self.config, keys)
            if where is not None and int(cv) != val:
                raise CheckpointError(
                    f"{self.path}/config.json {where} = {cv}, but the experts of layer "
                    f"{first.index} ({first.group.base}) have {what} = {val}")
        self._scan_dense()

    def _is_mtp_name(self, name: str) -> bool:
        if _is_mtp_head(name):
            return True
        if self.num_hidden_layers is not None and name.startswith(self.main_head):
            num = name[len(self.main_head):].split(".", 1)[0]
            return num.isdigit() and int(num) >= self.num_hidden_layers
        return False

    def _layer_spec(self, idx: int, g: _Group) -> _Layer:
        if g.per and g.fused:
            raise CheckpointError(f"layer {idx}: experts both per expert ({g.base}.<e>...) and "
                                  f"fused ({g.base}.gate_up_proj...); expected one form")
        if g.fused:
            if "up_proj" in g.fused or not self._gated():
                names = ", ".join(i.describe() for c in g.fused.values() for i in c.values())
                how = (f"config.json's model_type {model_type(self.config)!r} has experts without "
                       f"a gate, which are read per expert ({g.base}.<e>.up_proj.weight and "
                       f"down_proj.weight, as NVIDIA publishes and transformers saves them)"
                       if not self._gated() else
                       f"an up_proj stack belongs to experts without a gate, which config.json's "
                       f"model_type {model_type(self.config)!r} does not have")
                raise CheckpointError(f"layer {idx}: fused expert stacks ({names}) are not read: "
                                      f"{how}")
            return self._fused_spec(idx, g)
        return self._per_expert_spec(idx, g)

    def _per_expert_spec(self, idx: int, g: _Group) -> _Layer:
        if len(g.order) > 1:
            raise CheckpointError(f"layer {idx}: {g.base} names experts in both orders "
                                  f"(experts.<e>.<proj> and experts.<proj>.<e>)")
        order = next(iter(g.order))
        projs = {p for (_, p) in g.per}
        present = sorted({e for (e, _) in g.per})

        def mod(e, p):
            return f"{g.base}.{e}.{p}" if order == "ep" else f"{g.base}.{p}.{e}"

        gated = self._gated()
        if gated:
            spelling = next((s for s in SPELLINGS if projs <= set(s)), None)
            if spelling is None:
                raise CheckpointError(f"layer {idx}: {g.base} mixes projection names "
                                      f"{sorted(projs)}; expected gate_proj/up_proj/down_proj or "
                                      f"w1/w3/w2")
        else:
            spelling = NONGATED_SPELLING
            odd = sorted(projs - set(spelling))
            if odd:
                e = next(e for (e, p) in sorted(g.per) if p == odd[0])
                raise CheckpointError(
                    f"layer {idx}: {mod(e, odd[0])}.weight: config.json's model_type "
                    f"{model_type(self.config)!r} has experts without a gate (down(act(up·x))), "
                    f"named up_proj and down_proj; this checkpoint's experts have "
                    f"{sorted(projs)}")
        _, cfg_e = config_value(self.config, EXPERT_KEYS)
        n_exp = int(cfg_e) if cfg_e is not None else present[-1] + 1
        extra = [e for e in present if e >= n_exp]
        if extra:
            first = next(p for p in spelling if p)
            raise CheckpointError(f"layer {idx}: {mod(extra[0], first)}.weight is expert "
                                  f"{extra[0]}, but config.json gives {n_exp} experts")
        per: list = [[] if proj else None for proj in spelling]
        kinds: dict = {}
        for e in range(n_exp):
            for p, proj in enumerate(spelling):
                if proj is None:
                    continue
                comps = g.per.get((e, proj))
                if comps is None:
                    raise CheckpointError(
                        f"layer {idx}: tensor {mod(e, proj)}.weight is missing: the layer has "
                        f"{len(present)} of {n_exp} experts (present: {_short(present, 12)})")
                kind, roles = self._classify(mod(e, proj), comps, [mod(e, proj)])
                kinds.setdefault(kind, mod(e, proj))
                per[p].append(roles)
        if len(kinds) > 1:
            raise CheckpointError(f"layer {idx}: experts of different kinds, e.g. "
                                  f"{kinds[ExpertKind.FLOAT]} float and {kinds[ExpertKind.NVFP4]} "
                                  f"NVFP4; a layer's experts must share one")
        kind = next(iter(kinds))
        w0 = per[0 if gated else 1][0]["w"]            # gate (or up): [I, H]
        if len(w0.shape) != 2:
            raise CheckpointError(f"{w0.describe()}: expected a 2-D [I, H] weight")
        if kind is ExpertKind.FLOAT:
            i_, h_ = w0.shape
        else:
            i_, h_ = w0.shape[0], 2 * w0.shape[1]
        dtype = w0.dtype if kind is ExpertKind.FLOAT else None
        for p, shape in enumerate(((i_, h_), (i_, h_), (h_, i_))):
            for roles in per[p] or ():
                self._check_matrix(roles, kind, shape, dtype, ref=w0)
        with_bias = [(e, proj) for e in range(n_exp) for p, proj in enumerate(spelling)
                     if proj and "b" in per[p][e]]
        if with_bias and not gated:
            e0, p0 = with_bias[0]
            raise CheckpointError(f"layer {idx}: {mod(e0, p0)}.bias: experts without a gate "
                                  f"carry no biases in cupool's rows (RowLayout(gated=False))")
        if with_bias and len(with_bias) != 3 * n_exp:
            e, proj = next((e, proj) for e in range(n_exp) for p, proj in enumerate(spelling)
                           if "b" not in per[p][e])
            e0, p0 = with_bias[0]
            raise CheckpointError(f"layer {idx}: tensor {mod(e, proj)}.bias is missing, but "
                                  f"{mod(e0, p0)}.bias is there; a layer's experts have biases "
                                  f"on all three projections or on none")
        if with_bias:
            for p, rows in enumerate((i_, i_, h_)):
                for roles in per[p]:
                    self._check_bias(roles["b"], (rows,))
        fp8 = kind is ExpertKind.FLOAT and "s" in per[0 if gated else 1][0]
        if fp8 and not all("s" in r for rows in per if rows for r in rows):
            raise CheckpointError(f"layer {idx}: some experts' weights are FP8 with scales and "
                                  f"some are not; a layer's experts share one format")
        return _Layer(idx, g, kind, dtype, n_exp, h_, i_, per=per, bias=bool(with_bias),
                      source="fp8" if fp8 else "stored", gated=gated)

    def _check_bias(self, b: TensorInfo, shape: tuple) -> None:
        """A bias tensor's dtype (float) and shape, from the header."""
        if b.dtype not in FLOAT_DTYPES or tuple(b.shape) != tuple(shape):
            raise CheckpointError(f"{b.describe()}: expected a bf16/fp16/fp32 bias {list(shape)}")

    def _fused_biases(self, idx: int, g: _Group, r0: dict, r1: dict, n_exp: int, h_: int,
                      i_: int) -> bool:
        """Whether a fused layer has biases (gate_up_proj_bias [E, 2I] and down_proj_bias [E, H],
        both or neither), their headers checked."""
        have = [r.get("b") for r in (r0, r1)]
        if any(b is None for b in have) and any(b is not None for b in have):
            there = next(b for b in have if b is not None)
            proj = FUSED_PROJS[have.index(None)]
            raise CheckpointError(f"layer {idx}: tensor {g.base}.{proj}_bias is missing, but "
                                  f"{there.describe()} is there; a layer's experts have biases on "
                                  f"gate_up and down or on neither")
        if have[0] is None:
            return False
        self._check_bias(have[0], (n_exp, 2 * i_))
        self._check_bias(have[1], (n_exp, h_))
        return True

    def _interleaved(self) -> bool:
        """Whether fused gate_up stacks interleave gate and up (module docstring: the one rule)."""
        return model_type(self.config) in INTERLEAVED_MODEL_TYPES

    def _gated(self) -> bool:
        """Whether the experts have a gate projection (module docstring: the one rule)."""
        return model_type(self.config) not in NONGATED_MODEL_TYPES

    def _check_matrix(self, roles: dict, kind: ExpertKind, shape, dtype, ref: TensorInfo) -> None:
        """Shapes/dtypes of one matrix [N, K] as headers give them."""
        n, k = shape
        w = roles["w"]
        if kind is ExpertKind.FLOAT:
            if w.dtype != dtype or tuple(w.shape) != (n, k):
                raise CheckpointError(f"{w.describe()}: expected {str(dtype)[6:]} {[n, k]} like "
                                      f"{ref.describe()}")
            return
        if w.dtype != torch.uint8 or tuple(w.shape) != (n, k // 2):
            raise CheckpointError(f"{w.describe()}: expected uint8 {[n, k // 2]} (two E2M1 codes a "
                                  f"byte of a [{n}, {k}] weight, like {ref.describe()})")
        s, gl = roles["s"], roles["g"]
        if s.dtype != torch.float8_e4m3fn or tuple(s.shape) != (n, k // BLOCK):
            raise CheckpointError(f"{s.describe()}: expected float8_e4m3fn {[n, k // BLOCK]} (one "
                                  f"scale per {BLOCK} elements of {w.name} [{n}, {k}])")
        if gl.dtype != torch.float32 or gl.numel != 1 or len(gl.shape) > 1:
            raise CheckpointError(f"{gl.describe()}: expected a float32 scalar ([] or [1]): one "
                                  f"global scale per matrix")

    def _fused_spec(self, idx: int, g: _Group) -> _Layer:
        comps = {p: g.fused.get(p) for p in FUSED_PROJS}
        for p, c in comps.items():
            if c is None:
                other = next(i for cc in g.fused.values() for i in cc.values())
                raise CheckpointError(f"layer {idx}: tensor {g.base}.{p} is missing (the layer has "
                                      f"{other.describe()})")
        mods = [f"{g.base}.{p}" for p in FUSED_PROJS]
        (k0, r0), (k1, r1) = (self._classify(m, comps[p], [m, g.base])
                              for m, p in zip(mods, FUSED_PROJS))
        if k0 is not k1:
            raise CheckpointError(f"layer {idx}: {mods[0]} is {k0.value} but {mods[1]} is "
                                  f"{k1.value}; a layer's experts must share one kind")
        gu, dn = r0["w"], r1["w"]
        for t in (gu, dn):
            if len(t.shape) != 3:
                raise CheckpointError(f"{t.describe()}: expected a 3-D stack [E, N, K] of experts")
        n_exp = gu.shape[0]
        _, cfg_e = config_value(self.config, EXPERT_KEYS)
        if dn.shape[0] != n_exp or (cfg_e is not None and int(cfg_e) != n_exp):
            raise CheckpointError(f"layer {idx}: {gu.describe()} and {dn.describe()} hold "
                                  f"{n_exp} and {dn.shape[0]} experts; config.json gives "
                                  f"{cfg_e}")
        if k0 is ExpertKind.FLOAT and ("s" in r0 or "s" in r1):
            raise CheckpointError(f"layer {idx}: fused FP8 experts ({gu.describe()}) are not "
                                  f"supported; FP8 experts are read per expert "
                                  f"({g.base}.<e>.gate_proj.weight + weight_scale_inv), as "
                                  f"DeepSeek-V3, Kimi-K2 and Qwen publish them")
        if k0 is ExpertKind.FLOAT:
            (a, b), (c, d) = gu.shape[1:], dn.shape[1:]
            if (a, b) == (2 * d, c):
                h_, i_, tr = b, d, (False, False)
            elif (a, b) == (d, 2 * c):
                h_, i_, tr = a, c, (True, True)
            else:
                raise CheckpointError(f"layer {idx}: {gu.describe()} and {dn.describe()} are "
                                      f"neither [E, 2I, H] + [E, H, I] nor (transposed) "
                                      f"[E, H, 2I] + [E, I, H]")
            if gu.dtype != dn.dtype:
                raise CheckpointError(f"layer {idx}: {gu.describe()} and {dn.describe()} differ "
                                      f"in dtype")
            return _Layer(idx, g, k0, gu.dtype, n_exp, h_, i_, fused=(r0, r1), transposed=tr,
                          bias=self._fused_biases(idx, g, r0, r1, n_exp, h_, i_),
                          interleaved=self._interleaved())
        (n0, k_0, t0), (n1, k_1, t1) = (self._fused_nvfp4_shape(r) for r in (r0, r1))
        if n0 % 2 or (n0 // 2, k_0) != (k_1, n1):
            raise CheckpointError(f"layer {idx}: {gu.describe()} holds [E, {n0}, {k_0}] weights "
                                  f"and {dn.describe()} [E, {n1}, {k_1}]; expected [E, 2I, H] and "
                                  f"[E, H, I]")
        h_, i_ = k_0, k_1
        modes = []
        for r, n_rows in ((r0, n0), (r1, n1)):
            gl = r["g"]
            if gl.dtype != torch.float32:
                raise CheckpointError(f"{gl.describe()}: expected float32 global scales")
            if gl.numel == 1:
                modes.append("shared")
            elif tuple(gl.shape) in ((n_exp,), (n_exp, 1)):
                modes.append("expert")
            elif tuple(gl.shape) == (n_exp, 2) and r is r0:
                modes.append("expert_half")
            else:
                raise CheckpointError(f"{gl.describe()}: expected one global scale ([] or [1]), "
                                      f"one per expert ([{n_exp}]) or, for gate_up, one per expert "
                                      f"and half ([{n_exp}, 2])")
        return _Layer(idx, g, k0, None, n_exp, h_, i_, fused=(r0, r1), transposed=(t0, t1),
                      global_mode=tuple(modes),
                      bias=self._fused_biases(idx, g, r0, r1, n_exp, h_, i_),
                      interleaved=self._interleaved())

    def _fused_nvfp4_shape(self, roles) -> tuple[int, int, bool]:
        """(N, K, transposed) of a fused NVFP4 stack: packed [E, N, K/2] with scales [E, N, K/16],
        or transposed packed [E, K/2, N] with scales [E, K/16, N] (codes packed along dim 1)."""
        w, s = roles["w"], roles["s"]
        if w.dtype != torch.uint8:
            raise CheckpointError(f"{w.describe()}: expected uint8 packed E2M1 codes")
        if s.dtype != torch.float8_e4m3fn or len(s.shape) != 3 or s.shape[0] != w.shape[0]:
            raise CheckpointError(f"{s.describe()}: expected float8_e4m3fn block scales "
                                  f"[E, ., .] for {w.describe()}")
        a, b = w.shape[1:]
        if tuple(s.shape[1:]) == (a, 2 * b // BLOCK) and (2 * b) % BLOCK == 0:
            return a, 2 * b, False
        if tuple(s.shape[1:]) == (2 * a // BLOCK, b) and (2 * a) % BLOCK == 0:
            return b, 2 * a, True
        raise CheckpointError(f"{s.describe()} does not fit {w.describe()}: expected "
                              f"[E, {a}, {2 * b // BLOCK}] (codes [E, N, K/2] packed along the "
                              f"last dim) or [E, {2 * a // BLOCK}, {b}] (codes [E, K/2, N] packed "
                              f"along dim 1)")

    def _classify(self, module: str, comps: dict, aliases: list[str]):
        """(kind, roles) of one expert projection from its tensors; CheckpointError naming them
        for every format cupool does not serve."""
        served = ("cupool serves float (bf16/fp16/fp32), ModelOpt NVFP4, compressed-tensors "
                  "nvfp4-pack-quantized and gpt-oss MXFP4 experts")

        def refuse(what):
            raise CheckpointError(f"{module}: {what}; {served}")

        def d(k):
            return every[k].describe()

        every = comps
        bias = comps.get("bias")
        comps = {k: v for k, v in comps.items() if k != "bias"}
        if "blocks" in comps or ("scales" in comps and "weight" not in comps
                                 and "qweight" not in comps):
            found = ", ".join(d(k) for k in ("blocks", "scales") if k in comps)
            if self.format == "mxfp4":
                refuse(f"MXFP4 tensors ({found}) outside gpt-oss's fused layout: MXFP4 experts "
                       f"are read as {{mid}}.gate_up_proj_blocks / _scales and "
                       f"{{mid}}.down_proj_blocks / _scales")
            refuse(f"MXFP4 experts (gpt-oss style {found}) in a {self.format} checkpoint: they are "
                   f"read from checkpoints whose config.json quantization_config has quant_method "
                   f"'mxfp4' (or none)")
        if "qweight" in comps:
            found = ", ".join(d(k) for k in ("qweight", "qzeros", "scales") if k in comps)
            refuse(f"int4 AWQ/GPTQ experts ({found}) are not supported")
        if "pre_quant_scale" in comps:
            refuse(f"{d('pre_quant_scale')}: AWQ-style activation smoothing is not supported")
        nm = self.naming
        kind = None
        if "weight_packed" in comps:
            wp = comps["weight_packed"]
            if nm is None or nm.weight != "weight_packed":
                refuse(f"{wp.describe()} is a compressed-tensors tensor, but this is a "
                       f"{self.format} checkpoint")
            if wp.dtype == torch.int32:
                refuse(f"int4 compressed-tensors pack-quantized experts ({wp.describe()}) are not "
                       f"supported")
            if wp.dtype != torch.uint8 or nm.global_scale not in comps:
                extra = [d(k) for k in comps if k != "weight_packed"]
                refuse(f"{wp.describe()} with {extra} is not NVFP4 (needs {nm.global_scale}; "
                       f"MXFP4-style packing without one is not yet supported)")
            kind = ExpertKind.NVFP4
        else:
            w = comps.get("weight")
            if w is None:
                refuse(f"no weight tensor (found {[d(k) for k in every]})")
            if w.dtype in FLOAT_DTYPES:
                kind = ExpertKind.FLOAT
            elif w.dtype in FP8_DTYPES:
                scale = comps.get("weight_scale_inv") or comps.get("weight_scale")
                if scale is None or not self.reads_fp8_experts:
                    refuse(f"FP8 experts ({w.describe()}"
                           f"{', ' + scale.describe() if scale else ''}) are not supported "
                           f"here (block-scaled FP8 experts are read from checkpoints whose "
                           f"config.json quantization_config has quant_method 'fp8', or none, "
                           f"with weight_scale_inv / weight_scale beside each weight)")
                if len(w.shape) == 2:
                    self._fp8_layout(w, scale)           # the scale's shape fits the weight
                kind = ExpertKind.FLOAT
            elif w.dtype == torch.uint8:
                if nm is None or nm.weight != "weight":
                    refuse(f"{w.describe()} is a uint8 weight with no NVFP4 scales this "
                           f"{self.format} checkpoint knows")
                missing = [k for k in (nm.block_scale, nm.global_scale) if k not in comps]
                if missing:
                    refuse(f"{w.describe()} is packed NVFP4 but {missing} is missing")
                kind = ExpertKind.NVFP4
            elif w.dtype == torch.int8:
                refuse(f"int8 experts ({w.describe()}) are not supported")
            else:
                refuse(f"{w.describe()}: dtype {w.dtype} is not an expert format cupool reads")
        if kind is ExpertKind.FLOAT:
            roles = {"w": comps["weight"]}
            if comps["weight"].dtype in FP8_DTYPES:
                roles["s"] = comps.get("weight_scale_inv") or comps["weight_scale"]
        else:
            roles = {"w": comps[nm.weight], "s": comps[nm.block_scale],
                     "g": comps[nm.global_scale]}
        if bias is not None:
            roles["b"] = bias
        dec = self.declared(aliases)
        if dec is not None and dec[0] != kind.value:
            raise CheckpointError(f"{module}: {dec[1]} declares it {dec[0]}, but its tensors are "
                                  f"{kind.value} ({roles['w'].describe()})")
        return kind, roles

    # --- dense ---------------------------------------------------------------------------------
    def _scan_dense(self) -> None:
        names = [n for n in self.index.names() if n not in self._expert_names
                 and (self.include_mtp or not self._is_mtp_name(n))]
        by_mod: dict[str, dict[str, TensorInfo]] = {}
        for n in names:
            mod, _, leaf = n.rpartition(".")
            by_mod.setdefault(mod, {})[leaf] = self.index[n]
        quantized_ckpt = self.naming is not None or self.quant is not None
        self._dense: dict[str, _Dense] = {}
        done: set[str] = set()
        for n in names:
            if n in done:
                continue
            mod, _, leaf = n.rpartition(".")
            leaves = by_mod[mod]
            spec, folded = self._dense_module(mod, leaves)
            if spec is not None and leaf in folded:
                self._dense[spec.name] = spec
                done.update(f"{mod}.{x}" if mod else x for x in folded)
                continue
            if quantized_ckpt and leaf in KV_SCALES:
                done.add(n)
                continue
            info = leaves[leaf]
            if info.dtype in FP8_DTYPES:
                raise CheckpointError(f"{info.describe()}: an FP8 tensor with no weight_scale / "
                                      f"weight_scale_inv beside it")
            self._dense[n] = _Dense("plain", n, {"w": info}, tuple(info.shape))
            done.add(n)

    def _dense_module(self, mod: str, leaves: dict) -> tuple[_Dense | None, set]:
        """A quantized dense Linear `mod` (its `.weight` spec and the leaves folded into it)."""
        def full(x):
            return f"{mod}.{x}" if mod else x

        if "qweight" in leaves or ("weight_packed" in leaves
                                   and leaves["weight_packed"].dtype != torch.uint8):
            t = leaves.get("qweight") or leaves["weight_packed"]
            raise CheckpointError(f"{t.describe()}: int4 dense weights (AWQ/GPTQ/pack-quantized) "
                                  f"are not supported")
        if "pre_quant_scale" in leaves:
            raise CheckpointError(f"{leaves['pre_quant_scale'].describe()}: AWQ-style activation "
                                  f"smoothing is not supported")
        nm = self.naming
        acts = {a for a in ACTIVATION_SCALES if a in leaves}
        if nm is not None and nm.weight in leaves and leaves[nm.weight].dtype == torch.uint8 \
                and nm.block_scale in leaves and nm.global_scale in leaves:
            w, s, g = leaves[nm.weight], leaves[nm.block_scale], leaves[nm.global_scale]
            if len(w.shape) != 2:
                raise CheckpointError(f"{w.describe()}: expected a 2-D packed NVFP4 weight")
            n, k = w.shape[0], 2 * w.shape[1]
            self._check_matrix({"w": w, "s": s, "g": g}, ExpertKind.NVFP4, (n, k), None, w)
            folded = {nm.weight, nm.block_scale, nm.global_scale, *acts}
            return _Dense("nvfp4", full("weight"), {"w": w, "s": s, "g": g}, (n, k)), folded
        w = leaves.get("weight")
        if w is not None and w.dtype in FP8_DTYPES:
            s = leaves.get("weight_scale_inv") or leaves.get("weight_scale")
            if s is None:
                raise CheckpointError(f"{w.describe()}: FP8 weight with no weight_scale or "
                                      f"weight_scale_inv")
            if len(w.shape) != 2:
                raise CheckpointError(f"{w.describe()}: expected a 2-D FP8 weight")
            folded = {"weight", s.name.rpartition(".")[2], *acts}
            self._fp8_layout(w, s)
            return _Dense("fp8", full("weight"), {"w": w, "s": s}, tuple(w.shape)), folded
        return None, set()

    def _fp8_layout(self, w: TensorInfo, s: TensorInfo) -> tuple[str, int, int]:
        """("tensor" | "channel" | "block", bn, bk) of an FP8 weight's scale."""
        n, k = w.shape
        if s.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{s.describe()}: expected a float32/bf16/fp16 FP8 scale")
        if s.numel == 1:
            return "tensor", n, k
        if tuple(s.shape) in ((n,), (n, 1)):
            return "channel", 1, k
        if len(s.shape) == 2:
            for bn, bk in [b for b in (self.fp8_block(), (128, 128)) if b]:
                if tuple(s.shape) == (-(-n // bn), -(-k // bk)):
                    return "block", bn, bk
        raise CheckpointError(f"{s.describe()} does not fit {w.describe()}: expected a per-tensor "
                              f"[] / [1], per-channel [{n}] / [{n}, 1] or block "
                              f"[ceil({n}/128), ceil({k}/128)] scale")

    # --- public: experts -------------------------------------------------------------------------
    def _layer(self, layer: int) -> _Layer:
        try:
            spec = self._layers.get(int(layer))
        except (TypeError, ValueError):
            spec = None
        if spec is None:
            mtp = (f"; MTP layers {self.mtp_layers} need include_mtp=True"
                   if self.mtp_layers and not self.include_mtp else "")
            raise CheckpointError(f"layer {layer!r} has no routed experts in {self.path}; MoE "
                                  f"layers: {_short(self.moe_layers, 12)}{mtp}")
        return spec

    def expert_kind(self, layer: int) -> ExpertKind:
        """What `experts(layer, ...)` returns for this layer (layers can differ: a quantized
        checkpoint may keep some layers' experts in float)."""
        return self._layer(layer).kind

    def expert_names(self, layer: int) -> list[str]:
        """The tensor names holding this layer's routed experts (weights and scales)."""
        return self._layer(layer).group.names()

    def matrix_names(self, layer: int, start: int, stop: int) -> list[list[str]]:
        """[gate, up, down] lists of the weight tensors of experts [start, stop) of a per-expert
        layer (what conversion tallies name; gate [] for non-gated experts)."""
        spec = self._layer(layer)
        if spec.per is None:
            gu, dn = (f"{spec.group.base}.{p}" for p in FUSED_PROJS)
            return [[f"{t}[{e}]{h}" for e in range(start, stop)]
                    for t, h in ((gu, " (gate)"), (gu, " (up)"), (dn, ""))]
        return [[r["w"].name for r in spec.per[p][start:stop]] if spec.per[p] else []
                for p in range(3)]

    def experts(self, layer: int, start: int = 0, stop: int | None = None) -> Experts:
        """The experts [start, stop) of checkpoint layer `layer`, reading only those bytes.

        Returns `Experts`: float gate/up [n, I, H] and down [n, H, I] in the stored dtype, or
        NVFP4Tensors in ModelOpt's convention (scales checked, module docstring), gate None for
        experts without a gate, and the biases (float32) where the experts have them. Fused 3-D
        tensors are read as one dim-0 slice each; transposed ones ([E, H, 2I], [E, K/2, N]) are
        transposed into the [n, N, K] order and interleaved gate/up rows taken apart (one extra
        window-sized copy).
        """
        spec = self._layer(layer)
        stop = spec.experts if stop is None else int(stop)
        start = int(start)
        if not 0 <= start < stop <= spec.experts:
            raise CheckpointError(f"layer {layer}: experts [{start}, {stop}) are empty or outside "
                                  f"[0, {spec.experts})")
        if spec.fused is not None:
            mats = self._read_fused(spec, start, stop)
        else:
            mats = self._read_per_expert(spec, start, stop)
        bias = self._read_biases(spec, start, stop) if spec.bias else None
        return Experts(spec.kind, spec.index, start, stop, *mats, bias=bias)

    def _read_biases(self, spec: _Layer, start: int, stop: int):
        """float32 (gate [n, I], up [n, I], down [n, H]) biases of experts [start, stop);
        CheckpointError naming the tensor and index of a NaN/Inf."""
        n, H, I = stop - start, spec.hidden, spec.intermediate

        def finite(b, name, first):
            bad = ~torch.isfinite(b)
            if bool(bad.any()):
                at = [int(x) for x in torch.nonzero(bad)[0]]
                where = [first + at[0], *at[1:]] if first is not None else at[1:]
                raise CheckpointError(f"{name}: bias {float(b[tuple(at)])} at {where}; expert "
                                      f"biases must be finite")
            return b

        if spec.fused is not None:
            r0, r1 = spec.fused
            gu = finite(self.index.read(r0["b"].name, start, stop).float(), r0["b"].name, start)
            gate, up = (h.contiguous() for h in split_gate_up(gu, spec.interleaved))
            down = finite(self.index.read(r1["b"].name, start, stop).float(), r1["b"].name, start)
            return gate, up, down
        out = []
        for p, rows in enumerate((I, I, H)):
            b = torch.empty(n, rows, dtype=torch.float32)
            for i, r in enumerate(spec.per[p][start:stop]):
                b[i] = finite(self.index.read(r["b"].name).float()[None], r["b"].name, None)[0]
            out.append(b)
        return tuple(out)

    def _read_per_expert(self, spec: _Layer, start: int, stop: int):
        n, H, I = stop - start, spec.hidden, spec.intermediate
        out = []
        for p, (rows, cols) in enumerate(((I, H), (I, H), (H, I))):
            if spec.per[p] is None:                      # no gate projection
                out.append(None)
                continue
            roles = spec.per[p][start:stop]
            if spec.kind is ExpertKind.FLOAT and spec.source == "fp8":
                w = torch.empty(n, rows, cols, dtype=torch.float32)
                for i, r in enumerate(roles):
                    w[i] = self._fp8_dequantize(r["w"], r["s"])
                out.append(w)
                continue
            if spec.kind is ExpertKind.FLOAT:
                w = torch.empty(n, rows, cols, dtype=spec.dtype)
                for i, r in enumerate(roles):
                    self.index.read(r["w"].name, out=w[i])
                out.append(w)
                continue
            packed = torch.empty(n, rows, cols // 2, dtype=torch.uint8)
            scale = torch.empty(n, rows, cols // BLOCK, dtype=torch.float8_e4m3fn)
            g = torch.empty(n, dtype=torch.float32)
            for i, r in enumerate(roles):
                self.index.read(r["w"].name, out=packed[i])
                self.index.read(r["s"].name, out=scale[i])
                g[i] = self.index.read(r["g"].name).reshape(())
            q = NVFP4Tensor(packed, scale, self._global(g, lambda i, r=roles: r[i]["g"].name))
            check_nvfp4(q, lambda i, r=roles: r[i]["s"].name,
                        lambda i, r=roles: self._g_label(r[i]["g"].name), self.naming.hint)
            out.append(q)
        return out

    def _global(self, g: torch.Tensor, name_of) -> torch.Tensor:
        """ModelOpt-convention global scales from the stored ones (1 / stored when the format
        stores the reciprocal, after checking the stored value is finite and > 0)."""
        if not self.naming.reciprocal:
            return g
        bad = ~torch.isfinite(g) | (g <= 0)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise CheckpointError(f"{name_of(i)}: {self.naming.global_scale} {float(g[i])}; it "
                                  f"must be finite and > 0 (the global scale is its reciprocal)")
        return torch.ones_like(g) / g        # one correctly rounded float32 division each

    def _g_label(self, name: str) -> str:
        return f"1 / {name}" if self.naming.reciprocal else name

    def _read_fused(self, spec: _Layer, start: int, stop: int):
        n, I = stop - start, spec.intermediate
        r0, r1 = spec.fused
        if spec.kind is ExpertKind.FLOAT:
            gu = self.index.read(r0["w"].name, start, stop)
            dn = self.index.read(r1["w"].name, start, stop)
            if spec.transposed[1]:
                dn = dn.transpose(1, 2).contiguous()
            if spec.transposed[0] or spec.interleaved:
                gu = gu.transpose(1, 2) if spec.transposed[0] else gu
                gate, up = (h.contiguous() for h in split_gate_up(gu, spec.interleaved))
                return gate, up, dn
            return gu[:, :I], gu[:, I:], dn
        mats = []
        for r, tr, mode in zip((r0, r1), spec.transposed, spec.global_mode):
            packed = self.index.read(r["w"].name, start, stop)
            scale = self.index.read(r["s"].name, start, stop)
            if tr:
                packed = packed.transpose(1, 2).contiguous()
                scale = scale.transpose(1, 2).contiguous()
            gname = r["g"].name
            graw = self.index.read(gname).float()
            if mode == "shared":
                gs = graw.reshape(1).expand(n).contiguous()
                gs = (gs, gs)
            elif mode == "expert":
                gs = graw.reshape(-1)[start:stop].contiguous()
                gs = (gs, gs)
            else:
                gs = (graw[start:stop, 0].contiguous(), graw[start:stop, 1].contiguous())
            mats.append((r, packed, scale, gs))
        out = []
        for j, (r, packed, scale, gs) in enumerate(mats):
            if j == 0:
                ps = split_gate_up(packed, spec.interleaved)
                ss = split_gate_up(scale, spec.interleaved)
                labels = gate_up_rows(spec.interleaved, I)
                halves = [(ps[h], ss[h], gs[h], f" {labels[h]}") for h in (0, 1)]
                if spec.interleaved:
                    halves = [(p.contiguous(), s.contiguous(), g, rw) for p, s, g, rw in halves]
            else:
                halves = [(packed, scale, gs[0], "")]
            for p, s, g, rows in halves:
                sname, gname = r["s"].name, r["g"].name
                g = self._global(g, lambda i, gn=gname: f"{gn}[{start + i}]")
                q = NVFP4Tensor(p, s, g)
                check_nvfp4(q, lambda i, sn=sname, rw=rows: f"{sn}[{start + i}]{rw}",
                            lambda i, gn=gname: self._g_label(f"{gn}[{start + i}]"),
                            self.naming.hint)
                out.append(q)
        return out

    def expert_sizes(self, align: int = 256) -> ExpertSizes:
        """Sizes of the routed experts of `moe_layers` in NVFP4 and in the store (no data read)."""
        L, E, H, I = len(self.moe_layers), self.num_experts, self.hidden, self.intermediate
        row = RowLayout(H, I, bias=self.has_bias, gated=self.gated).row_bytes
        stride = -(-row // align) * align
        ck = sum(self.index[n].nbytes for idx in self.moe_layers for n in self.expert_names(idx))
        biases = L * E * (2 * I + H) * 4 if self.has_bias else 0
        m = 3 if self.gated else 2
        return ExpertSizes(L, E, H, I, L * E * m * H * I // 2, L * E * m * H * I // BLOCK,
                           L * E * m * 4, biases, row, L * E * stride, ck)

    # --- public: dense -------------------------------------------------------------------------
    def dense_names(self) -> list[str]:
        """Every tensor that is not a routed expert's weight or scale (nor an MTP tensor, unless
        include_mtp), in file order. A quantized dense Linear appears once, as `{module}.weight`
        (compressed-tensors' weight_packed included), its scales and activation scales folded in;
        KV-cache scales of a quantized checkpoint (k_scale, v_scale, ...) are left out."""
        return list(self._dense)

    def _dense_spec(self, name: str) -> _Dense:
        spec = self._dense.get(name)
        if spec is None:
            why = ("a routed-expert tensor" if name in self._expert_names else
                   "an MTP tensor (include_mtp=False)" if name in self.index else "not present")
            raise CheckpointError(f"{name!r} is not a dense tensor of {self.path} ({why}); similar "
                                  f"dense names: {self._similar_dense(name)}")
        return spec

    def _similar_dense(self, name: str) -> list[str]:
        import difflib
        return difflib.get_close_matches(name, list(self._dense), n=6, cutoff=0.5)

    def dense_shape(self, name: str) -> tuple[int, ...]:
        """The shape `dense_tensor(name)` returns (NVFP4 weights unpacked: [N, K])."""
        return self._dense_spec(name).shape

    def _nvfp4_spec(self, name: str) -> _Dense:
        spec = self._dense_spec(name)
        if spec.kind != "nvfp4":
            raise CheckpointError(f"{name!r} of {self.path} is a {spec.kind} dense tensor, not an "
                                  f"NVFP4 one (dense_kind {spec.kind!r})")
        return spec

    def dense_kind(self, name: str) -> str:
        """"plain" (stored as is), "nvfp4" or "fp8" (dequantized by dense_tensor)."""
        return self._dense_spec(name).kind

    def dense_tensor(self, name: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Dense tensor `name` in `dtype` (floating tensors; integer/bool ones come as stored).

        float tensors are cast; NVFP4 Linear weights (ModelOpt weight/weight_scale/weight_scale_2
        or compressed-tensors weight_packed/weight_scale/weight_global_scale) dequantized as
        e2m1 · block_scale · global_scale in float32; FP8 weights (float8 [N, K]) dequantized as
        w · scale with a per-tensor, per-channel ([N] or [N, 1]) or block ([ceil(N/bn),
        ceil(K/bk)], DeepSeek's 128×128 weight_scale_inv) scale. Then cast to `dtype`.
        """
        spec = self._dense_spec(name)
        r = spec.roles
        if spec.kind == "plain":
            t = self.index.read(r["w"].name)
            return t.to(dtype) if t.is_floating_point() else t
        if spec.kind == "nvfp4":
            return nvfp4.dequantize(self.dense_nvfp4(name), torch.float32).to(dtype)
        return self._fp8_dequantize(r["w"], r["s"]).to(dtype)

    def dense_nvfp4(self, name: str) -> NVFP4Tensor:
        """The NVFP4 dense Linear weight `name` as stored, in ModelOpt's convention: packed uint8
        [N, K/2], block_scale float8_e4m3fn [N, K/16], global_scale float32 [] (a reciprocal
        stored by the format, compressed-tensors' weight_global_scale, inverted), checked as
        every NVFP4 matrix read is (module docstring). What `dense_tensor` dequantizes; kept
        packed for the decode GEMVs (`cupool.dense_nvfp4`). CheckpointError naming `name` where
        its `dense_kind` is not "nvfp4"."""
        r = self._nvfp4_spec(name).roles
        g = self.index.read(r["g"].name).float().reshape(1)
        g = self._global(g, lambda i: r["g"].name)
        q = NVFP4Tensor(self.index.read(r["w"].name)[None], self.index.read(r["s"].name)[None], g)
        check_nvfp4(q, lambda i: r["s"].name, lambda i: self._g_label(r["g"].name),
                    self.naming.hint)
        return q[0]

    def _fp8_dequantize(self, w_info: TensorInfo, s_info: TensorInfo) -> torch.Tensor:
        """float32 [N, K]: an FP8 weight times its per-tensor, per-row or block scale."""
        w = self.index.read(w_info.name).float()
        s = self.index.read(s_info.name).float()
        how, bn, bk = self._fp8_layout(w_info, s_info)
        n, k = w.shape
        if how == "tensor":
            w = w * s.reshape(())
        elif how == "channel":
            w = w * s.reshape(n, 1)
        else:
            w = w * _expand_blocks(s, n, k, bn, bk)
        bad = ~torch.isfinite(w)
        if bool(bad.any()):
            at = [int(x) for x in torch.nonzero(bad)[0]]
            raise CheckpointError(f"{w_info.name}: dequantized value {float(w[tuple(at)])} at "
                                  f"{at} (with {s_info.name}); FP8 weights and scales must be "
                                  f"finite")
        return w

    def dense_bytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of every dense tensor as `dense_tensor(name, dtype)` returns it (no data read)."""
        item = torch.empty((), dtype=dtype).element_size()
        total = 0
        for spec in self._dense.values():
            w = spec.roles["w"]
            floating = spec.kind != "plain" or (isinstance(w.dtype, torch.dtype)
                                                and w.dtype.is_floating_point)
            total += math.prod(spec.shape) * item if floating else w.nbytes
        return total

    def dense_nvfp4_bytes(self, names) -> int:
        """Bytes of the NVFP4 dense weights `names` packed for the decode GEMVs
        (`cupool.dense_nvfp4`: ceil(N/16) strips of 16 rows × Kp columns, Kp = K rounded up to
        64, 9·Kp bytes a strip as `cupool.layout` lays them out); they sit beside the dequantized
        weights `dense_bytes` counts. No data read; CheckpointError naming a name whose
        `dense_kind` is not "nvfp4"."""
        return sum(dense_strips_bytes(*self._nvfp4_spec(name).shape) for name in names)

    # --- life cycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Close the checkpoint's files."""
        self.index.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({str(self.path)!r}, format={self.format!r}, "
                f"L={len(self.moe_layers)}, E={self.num_experts}, H={self.hidden}, "
                f"I={self.intermediate}{', bias' if self.has_bias else ''})")


def _fused_suffix(s: str) -> str:
    """A fused tensor's suffix as the per-expert leaf it stands for: '' / '.weight' -> 'weight',
    '_weight_scale' -> 'weight_scale', '_scale_inv' -> 'weight_scale_inv', '_blocks' -> 'blocks'."""
    if s in ("", ".weight"):
        return "weight"
    s = s.lstrip("_").lstrip(".")
    return "weight_scale_inv" if s == "scale_inv" else s
