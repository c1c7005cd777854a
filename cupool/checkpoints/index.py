"""The tensors of a checkpoint directory, from the safetensors headers alone.

A safetensors file is an 8-byte little-endian header length n, n bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then the
data, each tensor's bytes at [8 + n + begin, 8 + n + end), row-major. `TensorIndex` reads only
those headers (a few KiB a file) to learn every tensor's file, dtype, shape and byte range, so a
caller can plan from a checkpoint of any size without reading its data.

Data is read on demand with `TensorIndex.read`, which copies a tensor, or a run of leading-dim
slices of it, from the file into a fresh (or given) CPU tensor with plain reads (`readinto` on an
unbuffered file): no memory map, so no mapped file pages stay resident and count toward the
process's RSS after a window has been used (the kernel's page cache is not the process's memory).
Every dim-0 slice of a row-major tensor is one contiguous byte range, so reading experts
[start, stop) of a fused [E, N, K] tensor is one read of (stop - start) · N · K elements.

Layouts: a directory with model.safetensors.index.json ({"weight_map": {name: file}}) uses the
files and names the index lists (tensors a shard holds but the index does not name are not part
of the checkpoint); without an index, model.safetensors if present, else every *.safetensors file.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from pathlib import Path

import torch

from cupool.checkpoints.errors import CheckpointError, load_json

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000      # the safetensors format's own limit

# safetensors dtype codes -> torch dtypes (codes torch cannot hold stay strings: listed, not read)
ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
    "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
for _code, _name in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _name):
        ST_DTYPES[_code] = getattr(torch, _name)
ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2,
               "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
               "F64": 8}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: its file, dtype (a torch dtype, or the safetensors code where torch
    has none), shape, and absolute byte range [offset, offset + nbytes) in the file."""
    name: str
    file: Path
    dtype: torch.dtype | str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        """'name (dtype [shape], file)' for messages."""
        dt = str(self.dtype).replace("torch.", "")
        return f"{self.name} ({dt} {list(self.shape)}, {self.file.name})"


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its header; CheckpointError naming the file (and
    the tensor) when the file is too short, the header is not JSON, or a tensor's byte range does
    not fit its dtype and shape or lies beyond the end of the file (a truncated download)."""
    try:
        size = path.stat().st_size
        with open(path, "rb", buffering=0) as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors file "
                                      f"(it starts with an 8-byte header length)")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{path}: header length {n} bytes but the file has {size} "
                                      f"bytes: truncated, or not a safetensors file")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e})") from None
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: the safetensors header is not JSON ({e}): not a "
                              f"safetensors file, or a damaged one") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: the safetensors header is a {type(meta).__name__}, "
                              f"expected a JSON object")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, d in meta.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = d["dtype"], tuple(int(s) for s in d["shape"]), \
                d["data_offsets"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry "
                                  f"{d!r}") from None
        if any(s < 0 for s in shape) or not 0 <= begin <= end:
            raise CheckpointError(f"{path}: tensor {name!r}: shape {list(shape)} / data_offsets "
                                  f"[{begin}, {end}] are not valid")
        item = ST_ITEMSIZE.get(code)
        if item is not None and end - begin != math.prod(shape) * item:
            raise CheckpointError(f"{path}: tensor {name!r} is {code} {list(shape)} "
                                  f"({math.prod(shape) * item} bytes) but its data_offsets span "
                                  f"{end - begin} bytes")
        if base + end > size:
            raise CheckpointError(f"{path}: tensor {name!r} ends at byte {base + end} but the file "
                                  f"has {size} bytes: the file is truncated (an interrupted "
                                  f"download?)")
        out[name] = TensorInfo(name, path, ST_DTYPES.get(code, code), shape, base + begin,
                               end - begin)
    return out


class TensorIndex:
    """name -> `TensorInfo` over every file of a checkpoint directory, built from headers only.

    Files are opened for reading on first use and stay open until `close()` (a context manager
    closes them too). Construction either succeeds or raises CheckpointError holding nothing open.
    """

    def __init__(self, directory):
        self.directory = Path(directory)
        self._files: dict[Path, object] = {}
        self.infos: dict[str, TensorInfo] = {}
        d = self.directory
        index = d / INDEX_FILE
        if index.is_file():
            wm = load_json(index).get("weight_map")
            if not isinstance(wm, dict) or not wm:
                raise CheckpointError(f"{index}: no 'weight_map' object naming the tensors' files")
            by_file: dict[str, list[str]] = {}
            for name, fname in wm.items():
                by_file.setdefault(str(fname), []).append(name)
            for fname, names in by_file.items():
                f = d / fname
                if not f.is_file():
                    raise CheckpointError(f"{index}: shard {fname!r} (holding {len(names)} "
                                          f"tensors, e.g. {names[0]!r}) does not exist in {d}")
                header = read_header(f)
                for name in names:
                    info = header.get(name)
                    if info is None:
                        raise CheckpointError(f"{index} puts tensor {name!r} in {fname!r}, but "
                                              f"that file has no such tensor ({len(header)} "
                                              f"tensors in it)")
                    self.infos[name] = info
        else:
            single = d / SINGLE_FILE
            files = [single] if single.is_file() else sorted(d.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{d}: no {SINGLE_FILE}, no {INDEX_FILE} and no other "
                                      f"*.safetensors file")
            for f in files:
                for name, info in read_header(f).items():
                    if name in self.infos:
                        raise CheckpointError(f"{d}: tensor {name!r} is in both "
                                              f"{self.infos[name].file.name} and {f.name} and "
                                              f"there is no {INDEX_FILE} to say which is meant")
                    self.infos[name] = info

    # --- lookup -----------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def __len__(self) -> int:
        return len(self.infos)

    def names(self) -> list[str]:
        """Every tensor name, in index (or file) order."""
        return list(self.infos)

    def __getitem__(self, name: str) -> TensorInfo:
        info = self.infos.get(name)
        if info is None:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint {self.directory} "
                                  f"({len(self.infos)} tensors); similar names present: "
                                  f"{self.similar(name) or 'none'}")
        return info

    def get(self, name: str) -> TensorInfo | None:
        return self.infos.get(name)

    def similar(self, name: str, n: int = 6) -> list[str]:
        """Up to n names present that look like `name` (for messages)."""
        stem = name.rsplit(".", 2)[0]
        near = [k for k in self.infos if k.startswith(stem)] or list(self.infos)
        return difflib.get_close_matches(name, near, n=n, cutoff=0.5)

    # --- data ------------------------------------------------------------------------------
    def _file(self, path: Path):
        f = self._files.get(path)
        if f is None:
            try:
                f = open(path, "rb", buffering=0)       # noqa: SIM115 (kept open; close() closes)
            except OSError as e:
                raise CheckpointError(f"{path}: cannot be opened ({e})") from None
            self._files[path] = f
        return f

    def read(self, name: str, start: int | None = None, stop: int | None = None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name`, or its dim-0 slice [start, stop), as a CPU tensor of its own dtype.

        The bytes are read straight into `out` when given (a contiguous CPU tensor of the
        tensor's dtype and of the slice's shape), else into a fresh tensor. Only those bytes are
        read. CheckpointError names the tensor when its dtype has no torch equivalent, the slice
        is out of range, `out` does not fit, or the file ends early.
        """
        info = self[name]
        if not isinstance(info.dtype, torch.dtype):
            raise CheckpointError(f"{info.describe()}: safetensors dtype {info.dtype!r} has no "
                                  f"torch dtype here, so it cannot be read")
        shape = info.shape
        if start is None and stop is None:
            first, last, sub = 0, None, shape
        else:
            if not shape:
                raise CheckpointError(f"{info.describe()}: a scalar has no dim 0 to slice")
            first = 0 if start is None else int(start)
            last = shape[0] if stop is None else int(stop)
            if not 0 <= first <= last <= shape[0]:
                raise CheckpointError(f"{info.describe()}: slice [{first}, {last}) is outside "
                                      f"dim 0 of size {shape[0]}")
            sub = (last - first, *shape[1:])
        item = info.nbytes // info.numel if info.numel else 0
        row = item * math.prod(shape[1:]) if shape else item
        offset = info.offset + first * row if shape else info.offset
        nbytes = math.prod(sub) * item
        if out is None:
            out = torch.empty(sub, dtype=info.dtype)
        elif (out.dtype != info.dtype or tuple(out.shape) != tuple(sub) or not out.is_contiguous()
              or out.device.type != "cpu"):
            raise CheckpointError(f"{info.describe()}: out must be a contiguous CPU "
                                  f"{info.dtype} tensor {list(sub)}, got {out.dtype} "
                                  f"{list(out.shape)} on {out.device}")
        if nbytes:
            buf = memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B")
            f = self._file(info.file)
            f.seek(offset)
            done = 0
            while done < nbytes:
                got = f.readinto(buf[done:])
                if not got:
                    raise CheckpointError(f"{info.describe()}: the file ended after "
                                          f"{offset + done} bytes while reading bytes "
                                          f"[{offset}, {offset + nbytes}): truncated since it "
                                          f"was indexed")
                done += got
        return out

    def close(self) -> None:
        """Close every file opened for reading."""
        files, self._files = self._files, {}
        for f in files.values():
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
