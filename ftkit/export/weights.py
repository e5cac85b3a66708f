"""Streaming reconstruction of the trained weights, and sharded safetensors writing.

Memory is the point. ``zero_to_fp32`` concatenates every rank's partition into one flat vector per parameter
group (ZeRO-1/2: the whole model, then a copy of it as views), and ``save_pretrained`` wants a state dict: both
hold the whole model in host memory. Here every tensor has a reader (:class:`Entry`) that copies just that tensor
out of the checkpoint's files, and :func:`write_safetensors` writes one tensor at a time into the output shard it
belongs to: peak host memory is about the largest tensor (an embedding, or one layer's projection), however large
the model (``benchmarks/export_memory.py`` measures it).

How the files are read: DeepSpeed's ``.pt`` files are memory-mapped (``torch.load(mmap=True,
weights_only=True)``; the only pickled classes allowed are DeepSpeed's own, from the installed package), so
opening a 10 GB optimizer shard costs nothing until a tensor is copied out of it. Pages a copy touched stay
mapped into the process (and count in its RSS) until :meth:`Mapped.release` tells the kernel to drop them
(``madvise(MADV_DONTNEED)`` on the file's private, read-only-used mapping: the next touch reads them again from
the page cache or disk). safetensors files are read with ``pread`` per tensor, never mapped.

Where each tensor is, per layout (all fp32 master weights, DeepSpeed's own names):

- ZeRO-1/2 (and ZeRO-0 with bf16, DeepSpeed's BF16_Optimizer): each rank's ``single_partition_of_fp32_groups``
  holds a contiguous slice of each parameter group's flat vector; ``param_slice_mappings`` says which
  fragment of which parameter sits where (rank order = parameter order, as ``ds_to_universal`` reads them).
- ZeRO-3 (also with parameter/optimizer offload: the files are the same): every parameter is split into
  ``ceil(numel / world_size)`` elements per rank (the last one padded), laid end to end in ``fp32_flat_groups``
  in ``param_shapes`` order.
- ZeRO-0 (fp32/fp16): the full module state dict in ``mp_rank_00_model_states.pt`` (DeepSpeed keeps no flat
  fp32 copy there: what the module held is what was trained).
- universal: one ``zero/<name>/fp32.pt`` per parameter.
- HF files (``final/``, LoRA adapters, the base model of a merge): safetensors or ``pytorch_model.bin``.

Buffers (persistent ones) come from the model states' ``module``; tied/shared parameters are written once
(``from_pretrained`` ties them again from the config, as it does for ``save_pretrained``'s output).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import re
import struct
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, TypedDict, cast

from ftkit.export.source import ExportRefused

if TYPE_CHECKING:
    import ctypes

    import torch

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
MADV_DONTNEED = 4

# safetensors dtype names <-> torch dtype names (torch imported lazily)
_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
OUT_DTYPES = ("fp32", "bf16", "fp16")


class _Fragment(Protocol):
    """DeepSpeed's ``fragment_address``: where one parameter's fragment sits in a rank's flat partition."""

    start: int
    numel: int


class ZeroOptimizerState(TypedDict, total=False):
    """The ``optimizer_state_dict`` of a DeepSpeed ZeRO optimizer shard (the keys the readers use)."""

    single_partition_of_fp32_groups: list[torch.Tensor]  # ZeRO-1/2: this rank's slice of each group's flat vector
    param_slice_mappings: list[dict[str, _Fragment]]  # ZeRO-1/2, per group
    partition_count: int | list[int]
    fp32_flat_groups: list[torch.Tensor]  # ZeRO-3: this rank's sub-groups


class DeepSpeedStates(TypedDict, total=False):
    """A DeepSpeed ``.pt`` file of a ZeRO checkpoint, model states or optimizer states (the keys the readers use)."""

    module: dict[str, torch.Tensor]  # the module's state dict (ZeRO-3: this rank's empty placeholders)
    buffer_names: list[str]
    param_shapes: list[dict[str, torch.Size]]  # trainable parameters, one dict per group, in DeepSpeed's order
    frozen_param_shapes: dict[str, torch.Size]
    frozen_param_fragments: dict[str, torch.Tensor]
    shared_params: dict[str, str]  # alias -> the parameter it shares storage with
    optimizer_state_dict: ZeroOptimizerState


class _StTensor(TypedDict):
    """One tensor's entry in a safetensors header."""

    dtype: str
    shape: list[int]
    data_offsets: list[int]  # [begin, end) in the data section


def torch_dtype(name: str) -> torch.dtype:
    """``fp32|bf16|fp16`` (or a torch dtype name) -> torch dtype."""
    import torch

    alias = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    return getattr(torch, alias.get(name, name))


def parse_size(text: str | int) -> int:
    """``5GB`` -> 5_000_000_000, ``500MiB`` -> 524_288_000, ``123`` -> 123 (HF's ``max_shard_size`` spelling)."""
    if isinstance(text, int):
        size = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.I)
        if not m:
            raise ValueError(f"{text!r} is not a size (e.g. 5GB, 500MB, 2GiB)")
        unit = (m.group(2) or "B").upper()
        power = "BKMGT".index(unit[0])
        base = 1024 if "I" in unit else 1000
        size = int(float(m.group(1)) * base**power)
    if size < 1:
        raise ValueError(f"{text!r}: a shard size must be at least 1 byte")
    return size


def human(n: int) -> str:
    """Bytes as people read them: 512 B, 3.2 kB, 41.0 MB, 1.26 GB (powers of 1000, as --max-shard-size)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


# ------------------------------------------------------------------------------------------------- entries


@dataclass
class Entry:
    """One output tensor: its name in the written files, shape, source dtype, and how to copy it out."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # in the source
    read: Callable[[], torch.Tensor]  # -> a tensor the caller owns (never a view into a mapped file)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


CHUNK_BYTES = 64 << 20  # copies out of a mapped file go in chunks this large, each chunk's pages dropped after it
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# address ranges of the file mappings of live Mapped objects: only memory inside them is ever madvise'd
_LIVE_RANGES: list[tuple[int, int]] = []


class Mapped:
    """A ``.pt`` file loaded memory-mapped, with a way to drop the pages copies touched.

    The mapping's address range is what this load added to /proc/self/maps (another live load of the same file
    keeps its own); it is forgotten in :meth:`close`, before the mapping can go away, so no madvise ever reaches
    memory that is not this file's."""

    def __init__(self, path: Path):
        self.path = Path(path)
        before = set(_file_mappings(self.path))
        self.obj: object = load_pt(self.path)  # what the file pickles (None once closed)
        self._ranges = sorted(set(_file_mappings(self.path)) - before)
        _LIVE_RANGES.extend(self._ranges)

    def release(self) -> None:
        for start, end in self._ranges:
            _madvise_dontneed(start, end - start)

    def close(self) -> None:
        for r in self._ranges:
            _LIVE_RANGES.remove(r)
        self._ranges = []
        self.obj = None


def copy_out(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` for 1-D tensors, in :data:`CHUNK_BYTES` pieces; where ``src`` lies in a live file mapping,
    each piece's pages are dropped once copied, so a copy never keeps more than a chunk of the file resident."""
    step = max(1, CHUNK_BYTES // max(1, src.element_size()))
    for a in range(0, src.numel(), step):
        piece = src[a : a + step]
        dst[a : a + step].copy_(piece)
        _drop(piece)


def _drop(t: torch.Tensor) -> None:
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    for start, end in _LIVE_RANGES:
        if start <= lo and hi <= end:
            a, b = max(start, lo - lo % _PAGE), min(end, hi + (-hi % _PAGE))
            _madvise_dontneed(a, b - a)
            return


def cpu_only() -> None:
    """Exporting is CPU work: DeepSpeed, imported for its pickled classes or its converter, must not pick (or
    warn about) a GPU. Only before DeepSpeed is first imported: a training process keeps its accelerator."""
    if "deepspeed" not in sys.modules:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def load_pt(path: Path) -> object:
    """``torch.load(mmap=True, weights_only=True)`` allowing DeepSpeed's own pickled classes (LossScaler,
    ZeroStageEnum, fragment_address), imported from the installed package; any other class refuses the file."""
    import torch

    cpu_only()

    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as e:  # noqa: BLE001 - not a torch zip file (a legacy pickle, or damaged)
        raise ExportRefused(f"{path}: not a readable torch checkpoint file ({type(e).__name__}: {e})") from None
    foreign = [n for n in names if not n.startswith("deepspeed.")]
    if foreign:
        raise ExportRefused(f"{path}: pickles {foreign[0]}, which is not DeepSpeed's; refusing to unpickle it")
    allowed = []
    for name in names:
        module, _, attr = name.rpartition(".")
        try:
            allowed.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            raise ExportRefused(f"{path}: pickles {name}, which this DeepSpeed does not have") from None
    with torch.serialization.safe_globals(allowed):
        return torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of ``path`` (Linux: /proc/self/maps); [] elsewhere."""
    target = os.path.realpath(path)
    out = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.rstrip("\n").split(maxsplit=5)
                if len(parts) == 6 and parts[5] == target:
                    lo, hi = parts[0].split("-")
                    out.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return out


_libc: ctypes.CDLL | Literal[False] | None = None  # False: no libc to call


def _madvise_dontneed(start: int, length: int) -> None:
    """Drop the pages of a private, never-written file mapping from this process (they are re-read on touch)."""
    global _libc
    import ctypes

    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _libc = False
    if _libc:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_DONTNEED)


class Reader:
    """The tensors of one source, in output order, and the files they come from."""

    def __init__(
        self,
        entries: list[Entry],
        mapped: Iterable[Mapped] = (),
        files: Iterable[SafetensorsFile] = (),
        trainable: Iterable[str] | None = None,
    ):
        self.entries = entries
        # names DeepSpeed trained (its param_shapes); frozen parameters and buffers are the rest
        self.trainable = set(trainable) if trainable is not None else {e.name for e in entries}
        self.mapped = list(mapped)
        self.files = list(files)

    def release(self) -> None:
        for m in self.mapped:
            m.release()

    def close(self) -> None:
        for f in self.files:
            f.close()
        for m in self.mapped:
            m.close()
        self.mapped.clear()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------- DeepSpeed


def _model_state_files(tag_dir: Path, stage3: bool) -> list[Path]:
    if stage3:
        files = sorted(tag_dir.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"), key=_rank_of)
    else:
        files = [tag_dir / "mp_rank_00_model_states.pt"]
    if not files or not files[0].is_file():
        raise ExportRefused(f"{tag_dir.parent.name}: {tag_dir.name}/ has no model states file")
    return files


def _optim_files(tag_dir: Path) -> list[Path]:
    return sorted(tag_dir.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"), key=_rank_of)


def _rank_of(path: Path) -> int:
    m = re.search(r"zero_pp_rank_(\d+)_", path.name)
    return int(m.group(1)) if m else -1


def _states(m: Mapped) -> DeepSpeedStates:
    """A DeepSpeed file's content, as what it is (load_pt allowed nothing but DeepSpeed's classes into it)."""
    return cast(DeepSpeedStates, m.obj)


def _shapes(model_states: DeepSpeedStates) -> dict[str, tuple[int, ...]]:
    """Trainable parameters in DeepSpeed's order (``param_shapes`` is a list of one dict per group)."""
    out: dict[str, tuple[int, ...]] = {}
    for group in model_states.get("param_shapes") or []:
        for name, shape in group.items():
            out[name] = tuple(int(x) for x in shape)
    return out


def _buffers_and_frozen(ms: list[Mapped], stage3: bool) -> tuple[list[Entry], list[Entry], set[str]]:
    """Entries for persistent buffers and frozen parameters; names of shared (aliased) parameters to skip."""
    first = _states(ms[0])
    module = first.get("module") or {}
    buffers = []
    for name in first.get("buffer_names") or []:
        if name in module:
            t = module[name]
            buffers.append(Entry(name, tuple(t.shape), t.dtype, _copier(t)))
    frozen = []
    for name, size in (first.get("frozen_param_shapes") or {}).items():
        shape = tuple(int(x) for x in size)
        frags = [_states(m)["frozen_param_fragments"][name] for m in (ms if stage3 else ms[:1])]
        frozen.append(Entry(name, shape, frags[0].dtype, _concat_reader(frags, shape)))
    aliases = set((first.get("shared_params") or {}).keys())
    return buffers, frozen, aliases


def _copier(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        import torch

        out = torch.empty(t.shape, dtype=t.dtype)
        copy_out(out.reshape(-1), t.reshape(-1))
        return out

    return read


def _concat_reader(frags: list[torch.Tensor], shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    """Frozen parameters: ZeRO-1/2 keep each whole in the model states (one fragment), ZeRO-3 a padded piece per
    rank; the pieces laid end to end, cut to the parameter's size."""

    def read() -> torch.Tensor:
        import torch

        out = torch.empty(math.prod(shape), dtype=frags[0].dtype)
        at = 0
        for f in frags:
            n = min(f.numel(), out.numel() - at)
            if n <= 0:
                break
            copy_out(out[at : at + n], f.reshape(-1)[:n])
            at += n
        return out.view(shape)

    return read


def zero_reader(tag_dir: Path, stage: int) -> Reader:
    """The fp32 master weights of a DeepSpeed ZeRO checkpoint (``tag_dir`` = ``checkpoint-N/global_stepN``)."""
    stage3 = stage == 3
    ms = [Mapped(p) for p in _model_state_files(tag_dir, stage3)]
    optim = [Mapped(p) for p in _optim_files(tag_dir)]
    buffers, frozen, aliases = _buffers_and_frozen(ms, stage3)
    shapes = _shapes(_states(ms[0]))
    if stage3:
        trainable = _zero3_entries(tag_dir, shapes, optim)
    elif optim:
        trainable = _zero12_entries(tag_dir, shapes, optim)
    else:  # ZeRO-0 without a flat fp32 copy: the module's own weights
        module = _states(ms[0]).get("module") or {}
        names = [n for n in module if n not in {e.name for e in buffers}]
        trainable = [Entry(n, tuple(module[n].shape), module[n].dtype, _copier(module[n])) for n in names]
    entries = [e for e in [*trainable, *frozen, *buffers] if e.name not in aliases]
    return Reader(entries, [*ms, *optim], trainable={e.name for e in trainable})


def _osd(m: Mapped) -> ZeroOptimizerState:
    osd = _states(m).get("optimizer_state_dict")
    if not isinstance(osd, dict):
        raise ExportRefused(f"{m.path}: no optimizer_state_dict (not a DeepSpeed ZeRO optimizer shard)")
    return osd


def _zero12_entries(tag_dir: Path, shapes: dict[str, tuple[int, ...]], optim: list[Mapped]) -> list[Entry]:
    parts = []  # per rank: list per group of (flat fp32 partition, {name: (start, numel)})
    for m in optim:
        osd = _osd(m)
        flats = osd.get("single_partition_of_fp32_groups")
        maps = osd.get("param_slice_mappings")
        if flats is None or maps is None:
            raise ExportRefused(
                f"{m.path}: no single_partition_of_fp32_groups/param_slice_mappings (a DeepSpeed older than 0.10?)"
            )
        parts.append(
            [
                (flat, {n: (int(a.start), int(a.numel)) for n, a in gm.items()})
                for flat, gm in zip(flats, maps, strict=True)
            ]
        )
    world = len(parts)
    count = osd.get("partition_count")
    counts = count if isinstance(count, list) else [count]
    if any(isinstance(c, int) and c != world for c in counts):
        raise ExportRefused(f"{tag_dir.parent.name}: {world} optimizer shards, DeepSpeed says {counts[0]} partitions")

    def entry(name: str, shape: tuple[int, ...], group: int) -> Entry:
        pieces = [(p[group][0], *p[group][1][name]) for p in parts if name in p[group][1]]
        numel = math.prod(shape)
        if sum(n for _, _, n in pieces) != numel:
            raise ExportRefused(f"{tag_dir.parent.name}: {name}: the ranks' fragments do not add up to {shape}")

        def read() -> torch.Tensor:
            import torch

            out = torch.empty(numel, dtype=pieces[0][0].dtype)
            at = 0
            for flat, start, n in pieces:
                copy_out(out[at : at + n], flat[start : start + n])
                at += n
            return out.view(shape)

        return Entry(name, shape, pieces[0][0].dtype, read)

    entries = []
    for name, shape in shapes.items():
        group = next((g for g in range(len(parts[0])) if any(name in p[g][1] for p in parts)), None)
        if group is None:
            raise ExportRefused(f"{tag_dir.parent.name}: {name} is in no rank's param_slice_mappings")
        entries.append(entry(name, shape, group))
    return entries


def _zero3_entries(tag_dir: Path, shapes: dict[str, tuple[int, ...]], optim: list[Mapped]) -> list[Entry]:
    world = len(optim)
    if world == 0:
        raise ExportRefused(f"{tag_dir.parent.name}: {tag_dir.name}/ has no optimizer shards")
    flats = []
    for m in optim:
        groups = _osd(m).get("fp32_flat_groups")
        if not groups:
            raise ExportRefused(f"{m.path}: no fp32_flat_groups (not a ZeRO-3 optimizer shard)")
        flats.append(_Virtual(list(groups)))
    entries = []
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        per_rank = math.ceil(numel / world)
        entries.append(Entry(name, shape, flats[0].dtype, _zero3_reader(flats, offset, per_rank, shape)))
        offset += per_rank
    if offset != flats[0].numel:  # the same check zero_to_fp32 makes
        raise ExportRefused(
            f"{tag_dir.parent.name}: parameters take {offset} elements per rank, the shards hold {flats[0].numel}"
        )
    return entries


def _zero3_reader(
    flats: list[_Virtual], offset: int, per_rank: int, shape: tuple[int, ...]
) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        import torch

        numel = math.prod(shape)
        out = torch.empty(numel, dtype=flats[0].dtype)
        at = 0
        for flat in flats:
            n = min(per_rank, numel - at)
            if n <= 0:
                break
            flat.copy_into(out[at : at + n], offset, n)
            at += n
        return out.view(shape)

    return read


class _Virtual:
    """Several flat tensors read as one vector (ZeRO-3 sub-groups of one rank)."""

    def __init__(self, parts: list[torch.Tensor]):
        self.parts = parts
        self.dtype = parts[0].dtype
        self.starts = [0]
        for p in parts:
            self.starts.append(self.starts[-1] + p.numel())
        self.numel = self.starts[-1]

    def copy_into(self, out: torch.Tensor, start: int, n: int) -> None:
        at = 0
        for i, part in enumerate(self.parts):
            lo, hi = self.starts[i], self.starts[i + 1]
            if hi <= start or lo >= start + n:
                continue
            a, b = max(start, lo), min(start + n, hi)
            copy_out(out[at : at + (b - a)], part[a - lo : b - lo])
            at += b - a


def universal_reader(ckpt: Path, utag: str) -> Reader:
    """The fp32 weights of DeepSpeed's universal checkpoint ``ckpt/utag`` (``zero/<name>/fp32.pt`` each)."""
    udir = ckpt / utag
    states = sorted(udir.glob("*model_states.pt"))
    ms = [Mapped(states[0])] if states else []
    shapes = _shapes(_states(ms[0])) if ms else {}
    names = list(shapes) or sorted(p.name for p in (udir / "zero").iterdir() if (p / "fp32.pt").is_file())
    entries = []
    mapped = list(ms)
    for name in names:
        path = udir / "zero" / name / "fp32.pt"
        if not path.is_file():
            raise ExportRefused(f"{ckpt.name}: {utag}/zero/{name}/fp32.pt missing")
        m = Mapped(path)
        t = cast("torch.Tensor", m.obj["param"] if isinstance(m.obj, dict) else m.obj)
        shape = shapes.get(name, tuple(t.shape))
        if math.prod(shape) > t.numel():
            raise ExportRefused(f"{ckpt.name}: {utag}/zero/{name}/fp32.pt holds {t.numel()} elements, needs {shape}")
        entries.append(Entry(name, shape, t.dtype, _slice_reader(t, shape)))
        mapped.append(m)
    if ms:
        buffers, frozen, aliases = _buffers_and_frozen(ms, stage3=False)
        if frozen:
            raise ExportRefused(f"{ckpt.name}: a universal checkpoint with frozen parameters (LoRA): not supported")
        entries = [e for e in [*entries, *buffers] if e.name not in aliases]
    return Reader(entries, mapped, trainable=names)


def _slice_reader(t: torch.Tensor, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        import torch

        out = torch.empty(math.prod(shape), dtype=t.dtype)
        copy_out(out, t.reshape(-1)[: out.numel()])
        return out.view(shape)

    return read


# ------------------------------------------------------------------------------------------------- HF files


class SafetensorsFile:
    """A safetensors file read tensor by tensor with ``pread`` (no mapping, nothing resident but the tensor)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        try:
            (n,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
            header = json.loads(os.pread(self.fd, n, 8))
        except (struct.error, ValueError, OSError) as e:
            os.close(self.fd)
            raise ExportRefused(f"{self.path}: not a readable safetensors file ({e})") from None
        self.data_start = 8 + n
        header.pop("__metadata__", None)
        self.header = cast("dict[str, _StTensor]", header)

    def names(self) -> list[str]:
        return sorted(self.header, key=lambda k: self.header[k]["data_offsets"][0])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        import torch

        return getattr(torch, _ST_DTYPES[self.header[name]["dtype"]])

    def read(self, name: str) -> torch.Tensor:
        import torch

        info = self.header[name]
        begin, end = info["data_offsets"]
        buf = bytearray(end - begin)
        view = memoryview(buf)
        at = 0
        while at < len(buf):
            got = os.preadv(self.fd, [view[at:]], self.data_start + begin + at)
            if got <= 0:
                raise ExportRefused(f"{self.path}: {name} is truncated")
            at += got
        dtype = self.dtype(name)
        if not buf:
            return torch.empty(self.shape(name), dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).view(self.shape(name))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def hf_weight_files(directory: Path, stem: str = "model") -> list[Path]:
    """The weight files of an HF directory (``model.safetensors`` or its index, or ``pytorch_model.bin``)."""
    if (directory / f"{stem}.safetensors.index.json").is_file():
        index = json.loads((directory / f"{stem}.safetensors.index.json").read_text())
        return [directory / f for f in dict.fromkeys(index["weight_map"].values())]
    if (directory / f"{stem}.safetensors").is_file():
        return [directory / f"{stem}.safetensors"]
    bin_stem = "pytorch_model" if stem == "model" else stem
    if (directory / f"{bin_stem}.bin.index.json").is_file():
        index = json.loads((directory / f"{bin_stem}.bin.index.json").read_text())
        return [directory / f for f in dict.fromkeys(index["weight_map"].values())]
    if (directory / f"{bin_stem}.bin").is_file():
        return [directory / f"{bin_stem}.bin"]
    raise ExportRefused(f"{directory}: no {stem}.safetensors or {bin_stem}.bin weights")


def hf_reader(directory: Path, stem: str = "model") -> Reader:
    """Every tensor of an HF weights directory (safetensors per tensor, ``.bin`` memory-mapped)."""
    entries: list[Entry] = []
    files: list[SafetensorsFile] = []
    mapped: list[Mapped] = []
    for path in hf_weight_files(directory, stem):
        if path.suffix == ".safetensors":
            st = SafetensorsFile(path)
            files.append(st)
            entries += [Entry(n, st.shape(n), st.dtype(n), _st_reader(st, n)) for n in st.names()]
        else:
            m = Mapped(path)
            mapped.append(m)
            state = cast("dict[str, torch.Tensor]", m.obj)  # pytorch_model.bin: a state dict
            entries += [Entry(n, tuple(t.shape), t.dtype, _copier(t)) for n, t in state.items()]
    return Reader(entries, mapped, files)


def _st_reader(st: SafetensorsFile, name: str) -> Callable[[], torch.Tensor]:
    return lambda: st.read(name)


# ------------------------------------------------------------------------------------------------- writing


@dataclass
class Written:
    files: list[str]
    tensors: int
    bytes: int
    index: str | None


def plan_shards(entries: list[Entry], dtype: torch.dtype, max_bytes: int) -> list[list[Entry]]:
    """Split entries, in order, into shards of at most ``max_bytes`` (a larger tensor gets a shard of its own)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        n = out_bytes(e, dtype)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += n
    return [s for s in shards if s]


def out_dtype(e: Entry, dtype: torch.dtype) -> torch.dtype:
    return dtype if e.dtype.is_floating_point else e.dtype


def out_bytes(e: Entry, dtype: torch.dtype) -> int:
    return e.numel * out_dtype(e, dtype).itemsize


def _st_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    for st, tn in _ST_DTYPES.items():
        if tn == name:
            return st
    raise ExportRefused(f"cannot write {dtype} to safetensors")


def write_safetensors(
    path: Path,
    entries: list[Entry],
    dtype: torch.dtype,
    *,
    transform: Callable[[Entry, torch.Tensor], torch.Tensor] | None = None,
    after_each: Callable[[], None] | None = None,
) -> int:
    """Write ``entries`` into one safetensors file, one tensor at a time; returns the bytes of tensor data.

    The header is computed from names, shapes and dtypes before any data is read, then each tensor is read,
    converted (floating point to ``dtype``; integer and bool buffers keep theirs), optionally transformed (a LoRA
    merge), written and dropped. The layout is what ``safetensors.torch.save_file`` writes: little-endian u64
    header length, a JSON header padded with spaces to 8 bytes, tensors back to back in header order.
    """
    import torch

    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    at = 0
    for e in entries:
        n = out_bytes(e, dtype)
        header[e.name] = {"dtype": _st_name(out_dtype(e, dtype)), "shape": list(e.shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for e in entries:
            t = e.read()
            if transform is not None:
                t = transform(e, t)
            t = t.to(out_dtype(e, dtype)).contiguous()
            if tuple(t.shape) != e.shape:
                raise ExportRefused(f"{e.name}: read {tuple(t.shape)}, expected {e.shape}")
            if t.numel():
                fh.write(t.reshape(-1).view(torch.uint8).numpy().data)
            del t
            if after_each is not None:
                after_each()
    return at


def write_model(
    out_dir: Path,
    entries: list[Entry],
    dtype: torch.dtype,
    max_shard_bytes: int,
    *,
    transform: Callable[[Entry, torch.Tensor], torch.Tensor] | None = None,
    after_each: Callable[[], None] | None = None,
) -> Written:
    """``model.safetensors`` (one shard) or ``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json``,
    the names and index ``save_pretrained`` writes."""
    _check_unique(entries)
    shards = plan_shards(entries, dtype, max_shard_bytes)
    files = []
    total = 0
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        name = SAFE_SINGLE if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(out_dir / name, shard, dtype, transform=transform, after_each=after_each)
        files.append(name)
        weight_map.update({e.name: name for e in shard})
    index = None
    if len(shards) > 1:
        index = SAFE_INDEX
        body = {
            "metadata": {"total_size": total, "total_parameters": sum(e.numel for e in entries)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out_dir / index).write_text(json.dumps(body, indent=2) + "\n")
    return Written(files, len(entries), total, index)


def _check_unique(entries: list[Entry]) -> None:
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise ExportRefused(f"{e.name}: appears twice in the checkpoint")
        seen.add(e.name)
