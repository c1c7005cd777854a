"""Every CUDA source compiles with nvcc for every architecture cupool builds for, and the launchers'
rules and shared-memory arithmetic agree with the kernels (CPU tests; skipped where nvcc is
absent). The builds are registered in tests/kernel_builds.py."""

import dataclasses
import re
import shutil
import subprocess

import pytest
import torch
from kernel_builds import ARCHS, BUILDS, ROOT, VARIANTS, compile_many, nvcc_command

from cupool import _cuda, kernels
from cupool.activation import RELU2, SILU, swiglu_clamp
from cupool.layout import RowLayout
from cupool.ops import moe_decode
from cupool.ops.moe_gemm import PREFILL, w2_cols
from cupool.ops.moe_gemm import defines as config_defines
from cupool.ops.moe_gemm import shared_bytes as gemm_smem

SOURCES = kernels.sources()


def test_sources_found():
    names = {p.stem for p in SOURCES}
    assert {"selftest", "rowcopy"} <= names


def test_every_source_is_registered():
    """Each rawkernels/*.cu has its default build in kernel_builds.BUILDS, so the architecture
    matrix below compiles it."""
    assert {p.stem for p in SOURCES} <= {name for name, d in BUILDS if d == ""}


def test_every_build_is_registered_once():
    """No kernel's set of defines appears twice in kernel_builds.BUILDS and VARIANTS together
    (BUILDS compiles for every architecture, sm_90 included, so a VARIANTS copy of one is a second
    compile of the same cubin)."""
    seen: dict = {}
    for name, defines in BUILDS + VARIANTS:
        key = (name, frozenset(defines.split()))
        assert key not in seen, f"{name} {defines!r} is registered twice"
        seen[key] = defines


def test_the_matrix_is_cupools_architectures():
    assert ARCHS == tuple(_cuda.ARCHS)


@pytest.fixture(scope="module")
def arch_builds(tmp_path_factory):
    """{arch: [(name, defines, CompletedProcess)]}: every BUILDS entry compiled for every arch,
    all at once on every core (about 180 nvcc runs)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    jobs = [(name, d, arch) for arch in ARCHS for name, d in BUILDS]
    results = compile_many(nvcc, jobs, tmp_path_factory.mktemp("arch_builds"))
    out = {arch: [] for arch in ARCHS}
    for (name, d, arch), r in zip(jobs, results):
        out[arch].append((name, d, r))
    return out


@pytest.mark.parametrize("arch", ARCHS, ids=[f"sm_{a}" for a in ARCHS])
def test_every_build_compiles_for_the_architecture(arch_builds, arch):
    """Every production build compiles for sm_<arch> without warnings: an architecture-specific
    instruction outside its `__CUDA_ARCH__` branch fails here (ptxas: "requires .target sm_90")."""
    failed = [f"{name} {d}:\n{r.stderr.strip()}" for name, d, r in arch_builds[arch]
              if r.returncode or "warning" in r.stderr.lower()]
    assert not failed, f"{len(failed)} builds fail or warn for sm_{arch}:\n" + "\n".join(failed)


@pytest.mark.parametrize("name,defines", VARIANTS, ids=[f"{n}:{d}" for n, d in VARIANTS])
def test_nvcc_compiles_variants(name, defines, nvcc, tmp_path):
    r = subprocess.run(nvcc_command(nvcc, name, defines, 90, tmp_path / "out.cubin"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{name} {defines} failed to compile:\n{r.stderr}"


def ptxas_spills(nvcc, src, defines: dict, out) -> list[int]:
    """Bytes of spill stores of each kernel in src, as ptxas -v reports them."""
    r = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", f"-I{src.parent}", "-cubin", "-Xptxas", "-v",
                        *(f"-D{k}={v}" for k, v in defines.items()), "-o", str(out), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return [int(m) for m in re.findall(r"(\d+) bytes spill stores", r.stderr)]


@pytest.mark.parametrize("minb", [None, 3])
def test_prefill_config_fits_its_blocks_per_sm_without_spills(nvcc, tmp_path, minb):
    """gemm.PREFILL asks for MINB blocks per SM; its speed rests on the kernels fitting in the
    registers that leaves without spilling. MINB 3 (80 registers) is the counter-check: moe_w13
    spills there, so the check can see a spill."""
    cfg = PREFILL if minb is None else dataclasses.replace(PREFILL, minb=minb)
    defines = config_defines(cfg, RowLayout(2048, 768))
    spills = ptxas_spills(nvcc, kernels.kernel_dir() / "moe_gemm.cu", defines, tmp_path / "out.cubin")
    assert len(spills) == 3, spills                    # moe_w13, moe_w2, moe_finish
    if minb is None:
        assert max(spills) == 0, f"the prefill config {defines} spills: {spills}"
    else:
        assert max(spills) > 0, f"expected moe_w13 to spill at MINB={minb}: {spills}"


@pytest.mark.parametrize("nt,minb,spill", [(8, 3, False), (8, 4, False), (16, 3, False),
                                           (16, 4, True)])
def test_decode_blocks_per_sm_without_spills(nvcc, tmp_path, nt, minb, spill):
    """moe_decode.blocks_per_sm asks for 4 blocks per SM (64 registers) only with units
    of 8 lanes: they fit without spills, units of 16 do not (the counter-check)."""
    defines = {**RowLayout(2048, 768).defines(), "NT": nt, "MAXW": 64 if nt == 8 else 256,
               "MINB": minb}
    spills = ptxas_spills(nvcc, kernels.kernel_dir() / "moe_decode.cu", defines,
                          tmp_path / "out.cubin")
    assert len(spills) == 1 and (spills[0] > 0) == spill, spills


def test_decode_blocks_per_sm_rule():
    """4 blocks per SM where a call's w13 items (lanes · Ip/16) fill 4 blocks on every SM, and
    fill them twice or leave no more slots of the call's waves empty than 3 blocks would."""
    rule = moe_decode.blocks_per_sm
    qwen, big = RowLayout(2048, 768), RowLayout(4096, 1536)
    assert rule(qwen, 132, 8, 8) == 3                         # T=1, K=8: 384 items < 528
    assert rule(qwen, 132, 8, 32) == 4                        # T=4: 1,536
    assert rule(qwen, 132, 16, 128) == 3                      # units of 16 lanes: never 4
    assert rule(big, 132, 8, 8) == 4                          # 768 items
    # w13 items filling the 4-block grid less than twice: the waves of all the call's items
    gpt_oss = RowLayout(2880, 2880, bias=True)
    assert moe_decode.call_items(gpt_oss, 4, 4) == 720 + 360
    assert rule(gpt_oss, 132, 8, 4) == 3                      # T=1: 3 waves of 396 or of 528
    assert rule(gpt_oss, 132, 8, 8) == 4                      # T=2: 1,440 w13 items, 2.7 waves
    assert moe_decode.call_items(big, 8, 4) == 768 + 512      # 304 empty slots either way
    assert rule(gpt_oss, 188, 8, 4) == 3 and rule(gpt_oss, 170, 8, 4) == 4


@pytest.mark.parametrize("nt,minb,maxw", [(8, 4, 64), (16, 3, 256)])
def test_decode_w13_split_without_spills(nvcc, tmp_path, nt, minb, maxw):
    """w13 items of two strip pairs (W13_KSPLIT 2, the launcher's choice for large calls at
    H ≤ 2048) fit the same registers as one pair without spills."""
    defines = {**RowLayout(2048, 768).defines(), "NT": nt, "MAXW": maxw, "MINB": minb,
               "W13_KSPLIT": 2}
    spills = ptxas_spills(nvcc, kernels.kernel_dir() / "moe_decode.cu", defines,
                          tmp_path / "out.cubin")
    assert spills == [0], spills


@pytest.mark.parametrize("hidden,inter", [(2048, 768), (2048, 512), (4096, 1536), (4096, 1408)])
@pytest.mark.parametrize("lanes", [8, 32, 128])
def test_routed_decode_builds_without_spills(nvcc, tmp_path, hidden, inter, lanes):
    """The ROUTE builds the launcher picks (`choose(..., route=True)`) for the rows it routes
    (Hp ≤ ROUTE_MAX_HP: Qwen3-30B-A3B, Qwen3-Next, Qwen3-235B, GLM-4.5-Air) compile without
    spills; wider rows are refused by `route_fits`."""
    assert moe_decode.route_fits(1, 256, 7168) is not None
    assert moe_decode.route_fits(1, 256, hidden) is None
    layout = RowLayout(hidden, inter)
    x, w = torch.zeros(2, hidden, dtype=torch.bfloat16), torch.zeros(8)
    b = moe_decode.choose(layout, 132, lanes, x, w, route=True)
    defines = moe_decode.defines(b, layout, torch.bfloat16)
    assert defines["ROUTE"] == 1
    spills = ptxas_spills(nvcc, kernels.kernel_dir() / "moe_decode.cu", defines,
                          tmp_path / "out.cubin")
    assert spills == [0], (b, spills)


@pytest.mark.parametrize("tokens,norm,epi,warps,ks,rt", [
    (1, 1, 0, 4, 1, 1), (16, 1, 0, 4, 1, 1), (1, 0, 1, 4, 4, 1), (8, 1, 0, 8, 1, 2),
    (1, 1, 2, 8, 8, 1)])
def test_nvfp4_gemv_builds_without_spills(nvcc, tmp_path, tokens, norm, epi, warps, ks, rt):
    """dense_gemv's NVFP4 builds (two buffers of 8 chunks, or 4 with two row tiles, and the
    dequantised fragments of a chunk in registers) at the fused step's shapes and the widest ones
    fit without spills."""
    defines = {"NB": tokens, "MODE": norm, "EPI": epi, "WARPS": warps, "RT": rt, "WFP4": 1,
               **({"KS": ks} if ks > 1 else {})}
    spills = ptxas_spills(nvcc, kernels.kernel_dir() / "dense_gemv.cu", defines,
                          tmp_path / "out.cubin")
    assert spills == [0], (defines, spills)


def test_decode_w13_split_rule():
    """Two strip pairs a w13 item where Hp ≤ 2048 and lanes · Ip/32 fill the call's grid."""
    qwen, big = RowLayout(2048, 768), RowLayout(4096, 1536)
    split = lambda lanes, minb, layout=qwen: moe_decode.w13_split(layout, 132, lanes, minb)
    assert split(8, 3) == 4                                   # T=1: 192 items < 396 blocks
    assert split(16, 4) == 4                                  # T=2: 384 < 528
    assert split(24, 4) == 2                                  # T=3: 576
    assert split(32, 4) == 2 and split(128, 3) == 2
    assert split(32, 4, big) == 4                             # strips of 64 chunks: never


def test_decode_build_of_a_call():
    """choose() picks units of 8 lanes up to 64 lanes, the two rules, and x's alignment."""
    import torch
    layout = RowLayout(2048, 768)
    x = torch.zeros(4, 2048, dtype=torch.bfloat16)
    w = torch.zeros(32)
    b = moe_decode.choose(layout, 132, 32, x, w)
    assert (b.nt, b.maxw, b.minb, b.w13_split, b.xalign, b.w_dtype) == (8, 64, 4, 2, 1, 0)
    # x rows in shared memory: a variant profilers select, never the rules
    assert b.xsmem == 0 and "XSMEM" not in moe_decode.defines(b, layout, torch.bfloat16)
    xs = dataclasses.replace(b, xsmem=1)
    assert moe_decode.defines(xs, layout, torch.bfloat16)["XSMEM"] == 1
    b = moe_decode.choose(layout, 132, 128, x[:, 1:], w.bfloat16())
    assert (b.nt, b.maxw, b.minb, b.xalign, b.w_dtype) == (16, 256, 3, 0, 1)
    assert moe_decode.defines(b, layout, torch.float16)["OUT_BF16"] == 0


def test_decode_shared_memory_is_the_kernels_carve():
    """moe_decode.shared_bytes adds up moe_decode.cu's carve (stage rings, partial sums,
    SlotInfo, unit table) at both unit sizes; the w2 split mirrors the kernel's KS2."""
    ring = moe_decode.stage_ring_bytes()
    assert ring == 32 + 2 * 4 * 576                           # 2 barriers + parity, 2 stages
    # 8 rings, [8][NT/8 · 4][32] partial floats, SlotInfo, MAXW · (i64 + f32 + NT + 1) bytes
    for nt, maxw, want in ((8, 64, 37120 + 4096 + 64 + 1344), (16, 256, 37120 + 8192 + 128 + 7424)):
        b = moe_decode.Build(nt=nt, maxw=maxw, minb=3, w13_split=4, xalign=1, w_dtype=0)
        assert moe_decode.shared_bytes(b) == want
    # xsmem: the unit's x rows [NT][Hp + 8] bf16 after the table (and the biases), 16-byte aligned
    b = moe_decode.Build(nt=8, maxw=64, minb=3, w13_split=4, xalign=1, w_dtype=0, xsmem=1)
    assert moe_decode.shared_bytes(b, hp=2048) == 37120 + 4096 + 64 + 1344 + 8 * 2056 * 2
    assert moe_decode.shared_bytes(b, True, 2048) == 37120 + 4096 + 64 + 1344 + 512 + 8 * 2056 * 2
    with pytest.raises(ValueError, match="pass hp"):
        moe_decode.shared_bytes(b)
    assert [moe_decode.w2_ksplit(RowLayout(2048, i)) for i in (512, 768, 2048, 4096, 8192)] == \
        [1, 2, 2, 4, 8]
    assert moe_decode.w2_items(RowLayout(2048, 768)) == 2048 // 16 // 4
    assert moe_decode.w2_items(RowLayout(2048, 768), 4) == 2048 // 16 // 2     # forced (W2_KSPLIT)


def test_forced_w2_split_is_a_define_only_where_asked():
    """Build.w2_split 0 leaves W2_KSPLIT out (the kernel's rule: the default builds' source and
    defines are unchanged); 1, 2, 4, 8 up to the strip's chunks are passed, others refused."""
    layout = RowLayout(2048, 768)                             # 12 chunks a w2 strip
    b = moe_decode.Build(nt=8, maxw=64, minb=3, w13_split=4, xalign=1, w_dtype=0)
    assert "W2_KSPLIT" not in moe_decode.defines(b, layout, torch.bfloat16)
    for ks in (1, 2, 4, 8):
        d = moe_decode.defines(dataclasses.replace(b, w2_split=ks), layout, torch.bfloat16)
        assert d["W2_KSPLIT"] == ks
    for bad, lay in ((3, layout), (16, layout), (8, RowLayout(2048, 448))):   # 448: 7 chunks
        with pytest.raises(ValueError, match=r"w2_split must be 1, 2, 4 or 8 and at most the"):
            moe_decode.defines(dataclasses.replace(b, w2_split=bad), lay, torch.bfloat16)


def test_w2_split_rule():
    """w2_split_for: 4 warps a w2 strip for a launch of one token's lanes (plain or ROUTE) where
    the kernel's rule gives 2 to a strip of at most 16 chunks; everything else keeps the rule
    (0)."""
    qwen = RowLayout(2048, 768)                               # 12 chunks: the rule's 2
    assert [moe_decode.w2_split_for(qwen, n) for n in (1, 6, 8, 9, 16, 64)] == \
        [4, 4, 4, 0, 0, 0]
    for ip in (512, 1024 + 64, 1536, 2880):                   # 8, 17, 24, 45 chunks
        assert moe_decode.w2_split_for(RowLayout(2048, ip), 8) == 0
    assert moe_decode.w2_split_for(RowLayout(2048, 1024), 8) == 4      # 16 chunks
    # the call's items count the split's w2 items: 8 lanes at w13_split 4, 64 w2 items a unit
    assert moe_decode.call_items(qwen, 8, 4, 4) == 8 * 48 + 8 * 64
    x = torch.zeros(1, 2048, dtype=torch.bfloat16)
    assert moe_decode.choose(qwen, 132, 8, x, torch.zeros(8), route=True).w2_split == 4
    assert moe_decode.choose(qwen, 132, 8, x, torch.zeros(8)).w2_split == 4
    assert moe_decode.choose(qwen, 132, 16, x, torch.zeros(16)).w2_split == 0


# The served families' expert dims (published configs: hidden, moe_intermediate, experts, top-k)
# and the SM counts of the GPUs cupool builds for: RTX 3080 / 4080 / 3090 / 5080, A100, H100 PCIe,
# RTX 4090, H100 / H200, B200, RTX 5090, RTX PRO 6000.
SERVED_DIMS = {
    "Qwen3-30B-A3B": (RowLayout(2048, 768), SILU, 128, 8),
    "Qwen3-Next-80B-A3B": (RowLayout(2048, 512), SILU, 512, 10),
    "Qwen3-235B-A22B": (RowLayout(4096, 1536), SILU, 128, 8),
    "GLM-4.5-Air": (RowLayout(4096, 1408), SILU, 128, 8),
    "gpt-oss-120b": (RowLayout(2880, 2880, bias=True), swiglu_clamp(1.702, 7.0), 128, 4),
    "Nemotron-3-Nano-30B-A3B": (RowLayout(2688, 1856, gated=False), RELU2, 128, 6),
    "DeepSeek-V3": (RowLayout(7168, 2048), SILU, 256, 8),
}
SM_COUNTS = (68, 76, 82, 84, 108, 114, 128, 132, 148, 170, 188)


@pytest.mark.parametrize("family", sorted(SERVED_DIMS))
def test_launcher_decode_builds_are_registered(family):
    """Every moe_decode build the per-call rules choose (`choose`: plain, and ROUTE where
    `route_fits`) for 1 to 16 tokens at a served family's dims, on each GPU's SM count, is
    registered: in kernel_builds.BUILDS (Qwen3-30B-A3B's: compiled for every architecture) or
    VARIANTS (compiled for sm_90; the same -D sets at other dims)."""
    layout, activation, experts, top_k = SERVED_DIMS[family]
    registered = {frozenset(d.split()) for n, d in BUILDS + VARIANTS if n == "moe_decode"}
    x = torch.zeros(16, layout.hidden, dtype=torch.bfloat16)
    missing = set()
    for sms in SM_COUNTS:
        for route in (False, True):
            for T in range(1, 17):
                if route and moe_decode.route_fits(T, experts, layout.hp) is not None:
                    continue
                b = moe_decode.choose(layout, sms, T * top_k, x[:T], torch.zeros(T * top_k),
                                      route=route)
                d = moe_decode.defines(b, layout, torch.bfloat16, activation)
                flags = frozenset(f"-D{k}={v}" for k, v in d.items())
                if flags not in registered:
                    missing.add((sms, route, T, " ".join(sorted(flags))))
    assert not missing, sorted(missing)[:4]


def test_prefill_staging_fits_two_blocks_per_sm():
    """PREFILL's MINB=2 also needs two blocks' shared memory on an SM (H100/H200: 228 KiB, 1 KiB
    of it reserved per block). At Qwen3-30B-A3B dims moe_w2 stages all of I once per unit; at
    I=1536 that would not fit twice, so it streams I in KC-column stages, double-buffered."""
    for layout in (RowLayout(2048, 768), RowLayout(4096, 1536), RowLayout(80, 48)):
        for kernel in ("moe_w13", "moe_w2"):
            assert 2 * (gemm_smem(PREFILL, layout, kernel) + 1024) <= 228 * 1024, (layout, kernel)
    assert w2_cols(PREFILL, RowLayout(2048, 768)) == 768
    assert w2_cols(PREFILL, RowLayout(4096, 1536)) == PREFILL.kc
    qwen = RowLayout(2048, 768)       # w13: 8 stages of 256 columns, two buffers of 64 rows
    assert gemm_smem(PREFILL, qwen, "moe_w13") == 2 * 64 * (256 + 8) * 2 + 64 * 8
    assert gemm_smem(PREFILL, qwen, "moe_w2") == 64 * (768 + 8) * 2 + 64 * 8


def test_expand_inlines_headers_with_line_markers():
    text, headers = kernels.expand("rowcopy")
    assert any(h.name == "common.cuh" for h in headers)
    assert '#line 1 "rawkernels/common.cuh"' in text
    assert '#include "common.cuh"' not in text
    # the line after the include maps back to the source file
    assert '#line' in text and 'rawkernels/rowcopy.cu' in text


def test_expand_missing_source_names_the_file():
    with pytest.raises(FileNotFoundError, match="no_such_kernel"):
        kernels.expand("no_such_kernel")


def test_defines_are_validated():
    with pytest.raises(ValueError, match="not a C identifier"):
        kernels._options({"bad name": 1})
    assert "-DUNROLL=4" in kernels._options({"UNROLL": 4})


def test_debug_env_adds_lineinfo(monkeypatch):
    monkeypatch.setenv("CUPOOL_KERNEL_DEBUG", "1")
    assert "-lineinfo" in kernels._options(None)
    monkeypatch.setenv("CUPOOL_KERNEL_DEBUG", "0")
    assert "-lineinfo" not in kernels._options(None)


# gpt-oss experts (biases in the rows, clamped SwiGLU compiled in, H = I = 2880: 45 chunks a
# strip, not a power of two): every build the launchers make for them compiles without spills.
_GPTOSS = RowLayout(2880, 2880, bias=True)


def _decode_builds(layout, act):
    """moe_decode's defines for `layout` and `act` in each build the launcher picks from (units
    of 8 lanes at 3 or 4 blocks an SM, of 16 at 3; W13_KSPLIT 4 or 2)."""
    out = []
    for nt, maxw, minb, split in [(8, 64, 4, 4), (8, 64, 3, 4), (8, 64, 4, 2), (16, 256, 3, 4),
                                  (16, 256, 3, 2)]:
        b = moe_decode.Build(nt=nt, maxw=maxw, minb=minb, w13_split=split, xalign=1, w_dtype=0)
        out.append(moe_decode.defines(b, layout, torch.bfloat16, act))
    return out


def _gptoss_decode_builds():
    from cupool.activation import swiglu_clamp
    return _decode_builds(_GPTOSS, swiglu_clamp(1.702, 7.0))


@pytest.mark.parametrize("defines", _gptoss_decode_builds(),
                         ids=lambda d: f"NT{d['NT']}-MINB{d['MINB']}-KS{d['W13_KSPLIT']}")
def test_gptoss_decode_builds_without_spills(nvcc, tmp_path, defines):
    assert defines["ROW_BIAS"] == 1 and defines["ACT"] == 1
    spills = ptxas_spills(nvcc, kernels.kernel_dir() / "moe_decode.cu", defines, tmp_path / "o.cubin")
    assert spills and all(s == 0 for s in spills), spills


def _prefill_and_pair_spills(nvcc, tmp_path, layout, act):
    """(config, ptxas spill counts) of moe_gemm's prefill and pair-decode builds for `layout`."""
    from cupool.ops.moe_gemm import PAIR_SMALL, PAIR_WIDE
    for cfg in (PREFILL, PAIR_SMALL, PAIR_WIDE):
        d = config_defines(cfg, layout, torch.bfloat16, act)
        yield cfg, ptxas_spills(nvcc, kernels.kernel_dir() / "moe_gemm.cu", d, tmp_path / "o.cubin")


def test_gptoss_prefill_and_pair_builds_without_spills(nvcc, tmp_path):
    from cupool.activation import swiglu_clamp
    for cfg, spills in _prefill_and_pair_spills(nvcc, tmp_path, _GPTOSS, swiglu_clamp(1.702, 7.0)):
        assert spills and all(s == 0 for s in spills), (cfg, spills)


# Experts without a gate (Nemotron-3-Nano-30B-A3B: H=2688, I=1856, up strips alone, ReLU(up)²):
# every build the launchers make for them compiles without spills.
_NEMOTRON = RowLayout(2688, 1856, gated=False)


def _nemotron_decode_builds():
    from cupool.activation import RELU2
    return _decode_builds(_NEMOTRON, RELU2)


@pytest.mark.parametrize("defines", _nemotron_decode_builds(),
                         ids=lambda d: f"NT{d['NT']}-MINB{d['MINB']}-KS{d['W13_KSPLIT']}")
def test_nongated_decode_builds_without_spills(nvcc, tmp_path, defines):
    assert defines["ROW_GATED"] == 0 and defines["ACT"] == 2
    spills = ptxas_spills(nvcc, kernels.kernel_dir() / "moe_decode.cu", defines, tmp_path / "o.cubin")
    assert spills and all(s == 0 for s in spills), spills


def test_nongated_prefill_and_pair_builds_without_spills(nvcc, tmp_path):
    from cupool.activation import RELU2
    for cfg, spills in _prefill_and_pair_spills(nvcc, tmp_path, _NEMOTRON, RELU2):
        assert len(spills) == 3 and all(s == 0 for s in spills), (cfg, spills)


@pytest.mark.parametrize("name", ["moe_decode", "moe_gemm"])
@pytest.mark.parametrize("defines,message", [
    ("-DROW_GATED=0", "is the activation of rows without a gate"),           # SiLU, no gate
    ("-DACT=2 -DACT_ALPHA=1.0f -DACT_LIMIT=1.0f", "is the activation of rows without a gate"),
    ("-DROW_GATED=0 -DACT=2 -DROW_BIAS=1", "rows without a gate carry no biases"),
    ("-DROW_GATED=0 -DACT=2 -DROW_W2_OFFSET=1769728", "w2's offset differs"),   # the gated one
    ("-DROW_W2_OFFSET=884992", "w2's offset differs"),                        # the non-gated one
])
def test_kernels_refuse_what_they_have_no_build_for(nvcc, tmp_path, name, defines, message):
    """moe_common.cuh's static_asserts: a layout and an activation that do not pair, biases in
    rows without a gate, and a ROW_W2_OFFSET (cupool/layout.py's) other than the kernel's."""
    r = subprocess.run(nvcc_command(nvcc, name, defines, 90, tmp_path / "o.cubin"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and message in r.stderr, r.stderr


# The fused step's GEMV launch shapes (CUPOOL_DENSE_SHAPE): blocks of 4 warps, K split over
# blocks; and the router builds that write lane addresses (CUPOOL_SKIP_PLAN)
_DENSE_SHAPES = [d for n, d in BUILDS + VARIANTS if n == "dense_gemv"
                 and ("-DWARPS=4" in d or "-DKS=" in d or "-DLANE_ADDR=" in d)]


@pytest.mark.parametrize("defines", _DENSE_SHAPES)
def test_dense_gemv_launch_shapes_without_spills(nvcc, tmp_path, defines):
    """Each launch shape compiles for sm_90 without spills, and at one token a block of 4 warps
    keeps to 128 registers a thread: 4 such blocks an SM (4 · 128 threads · 128 registers is the
    SM's 64K), the occupancy that shape is there for (a 320-block QKV grid in one wave). An
    NVFP4 build that dequantises 8 chunks before its wait (PRE=8) keeps to 168: 3 blocks an SM,
    still one wave for that grid on an H200 (the launcher checks the grid is resident)."""
    r = subprocess.run(nvcc_command(nvcc, "dense_gemv", defines, 90, tmp_path / "o.cubin",
                                    ("-Xptxas", "-v")), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    spills = [int(m) for m in re.findall(r"(\d+) bytes spill stores", r.stderr)]
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", r.stderr)]
    assert len(spills) == 1 and spills[0] == 0, f"{defines} spills: {spills}"
    if "-DWARPS=4" in defines and "-DNB=1 " in defines:
        cap = 168 if "-DPRE=8" in defines else 128
        blocks = 65536 // (128 * cap)
        assert regs[0] <= cap, f"{defines}: {regs[0]} registers, fewer than {blocks} blocks an SM"


_LANE_ADDR_BUILDS = [d for n, d in BUILDS if n == "dense_gemv" and "-DLANE_ADDR=1" in d]


@pytest.mark.parametrize("arch", ARCHS, ids=[f"sm_{a}" for a in ARCHS])
def test_dense_gemv_lane_addr_builds_without_spills(nvcc, tmp_path, arch):
    """The router builds that write lane addresses (CUPOOL_SKIP_PLAN) compile for every
    architecture without spills."""
    assert _LANE_ADDR_BUILDS
    for i, defines in enumerate(_LANE_ADDR_BUILDS):
        r = subprocess.run(nvcc_command(nvcc, "dense_gemv", defines, arch, tmp_path / f"{i}.cubin",
                                        ("-Xptxas", "-v")),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        spills = [int(m) for m in re.findall(r"(\d+) bytes spill stores", r.stderr)]
        assert len(spills) == 1 and spills[0] == 0, f"sm_{arch} {defines} spills: {spills}"


def test_dense_gemv_refuses_other_launch_shapes(nvcc, tmp_path):
    for defines, message in (("-DWARPS=2", "a block of 4 or 8 warps"),
                             ("-DKS=17", "K split over 1 to 16 blocks"),
                             ("-DEPI=0 -DLANE_ADDR=1", "lane addresses are written by the route")):
        r = subprocess.run(nvcc_command(nvcc, "dense_gemv", defines, 90, tmp_path / "o.cubin"),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and message in r.stderr, (defines, r.stderr[-500:])


def test_graph_copies_probe_builds(nvcc, tmp_path):
    """benchmarks/probe_graph_copies.cu (conditional SWITCH nodes of row copies, run by
    `run_gpu.sh graph-copies`) builds without warnings, so a GPU run finds it ready."""
    src = ROOT / "benchmarks" / "probe_graph_copies.cu"
    r = subprocess.run([nvcc, "-std=c++17", "-O2", "-arch=sm_90", "-Xcompiler", "-Wall",
                        "-o", str(tmp_path / "probe"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "warning" not in r.stderr.lower(), r.stderr
