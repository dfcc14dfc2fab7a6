"""THE feature storage format: shard writer, memory-mapped reader, index, checksums, fp8 codec.

Layout of a finished extraction (``runs/<run>/extract/``; full description in docs/storage.md)::

    manifest.json                 fingerprint, counts, sha256 of every shard (pipeline.stage_dir.StageDir)
    index.parquet                 one row per sample: id, shard, row, token_offset, length, num_loss_tokens, source_row
    shards/NNNNN.safetensors      one unit of work; a valid safetensors file, token-major
    shards/NNNNN.done.json        sidecar: bytes + sha256 (a unit is done iff it matches)

A shard is a safetensors file whose tensors are, in this byte order (each region aligned for its dtype)::

    sample_offsets  I64  [N+1]      token offset of each sample inside the shard (0, S0, S0+S1, ...)
    input_ids       I32  [T]
    loss_mask       U8   [T]
    features        BF16|F32|F8_E4M3 [T, n, D]   taps concatenated shallow -> deep == [T, n*D]
    scales          F32  [T, n]     fp8 only: per-token-per-tap dequantization scale
    (_padK          U8   zero bytes that align the next region; safetensors allows no holes)

``__metadata__`` holds the format version, sample ids, source rows and the tap layout as JSON strings.
The header and every small tensor are known before extraction starts (lengths come from the tokenize
stage), so the file is pre-sized and features are written in place with ``pwrite`` by token offset —
from any thread or process (the vLLM connector), in any order, with no second pass.  Readers ``np.memmap`` the file and view regions as
torch tensors without copying; nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from pipeline.errors import StageError
from pipeline.files import sha256_file, with_path
from pipeline.records import BOOL, INT, STR, Optional, read_record
from pipeline.stage_dir import FILE_ENTRY, MANIFEST, StageDir

FORMAT_VERSION = "dflash-features/1"
INDEX_FILE = "index.parquet"
SHARD_EXT = "safetensors"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MIN_SCALE = 1e-12  # an all-zero row gets this scale (its codes are all zero)

# storage dtype -> (safetensors dtype, torch dtype, bytes per element)
STORAGE_DTYPES: dict[str, tuple[str, torch.dtype, int]] = {
    "bfloat16": ("BF16", torch.bfloat16, 2),
    "float32": ("F32", torch.float32, 4),
    "fp8": ("F8_E4M3", torch.float8_e4m3fn, 1),
}
_ST_DTYPES = {"I64": (torch.int64, 8), "F32": (torch.float32, 4), "I32": (torch.int32, 4), "U8": (torch.uint8, 1),
              "BF16": (torch.bfloat16, 2), "F8_E4M3": (torch.float8_e4m3fn, 1)}


def _check_storage_dtype(storage_dtype: str) -> None:
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage_dtype {storage_dtype!r} is not one of {sorted(STORAGE_DTYPES)}")


# What readers of a finished extraction read from its manifest (pipeline/records.py shape)
STORE_MANIFEST = {"fingerprint": {"layer_ids": [INT], "last_hidden": Optional(BOOL), "hidden_size": INT,
                                  "storage_dtype": STR},
                  "storage": {"shards": [STR], "index": Optional(FILE_ENTRY)}, "files": [FILE_ENTRY]}


def read_store_manifest(path: Path) -> dict:
    """The manifest of the finished extraction at `path`, checked (a damaged one names the file and what to run)."""
    stage = StageDir(Path(path).parent, Path(path).name)
    return read_record(Path(path) / MANIFEST, STORE_MANIFEST, repair=stage.repair_manifest
                       + " (or `drafter extract --repair`)")


def stored_taps(fingerprint: dict) -> int:
    """Taps stored per token of an extraction with this fingerprint: the drafter's ``layer_ids``, plus one when
    ``last_hidden`` says the last layer's output follows them (extract.layers.stored_tap_ids; extractions made
    before that field store the drafter's taps only)."""
    return len(fingerprint["layer_ids"]) + int(bool(fingerprint.get("last_hidden", False)))


def bytes_per_token(num_taps: int, hidden_size: int, storage_dtype: str) -> int:
    """Bytes one token costs in a shard: features (+ fp8 scales) + int32 input id + uint8 loss mask."""
    _check_storage_dtype(storage_dtype)
    per = STORAGE_DTYPES[storage_dtype][2]
    scales = 4 * num_taps if storage_dtype == "fp8" else 0
    return num_taps * hidden_size * per + scales + 4 + 1


# ----------------------------------------------------------------------------------------------
# Codec: compute dtype <-> storage dtype
# ----------------------------------------------------------------------------------------------


def encode_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (codes ``float8_e4m3fn [..., D]``, scales ``float32 [...]``), one scale per row.

    scale = amax(|row|) / 448, so every row uses the full e4m3 range; ``x ≈ codes * scale``.
    """
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(FP8_MIN_SCALE)
    codes = (xf / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def decode_fp8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of `encode_fp8`: ``codes [..., D] * scales [...]`` in ``dtype``."""
    return (codes.float() * scales.float().unsqueeze(-1)).to(dtype)


def encode_features(features: torch.Tensor, num_taps: int, storage_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-major features ``[T, n*D]`` (any float dtype, any device) -> what a shard stores.

    Returns (data ``[T, n, D]`` in the storage dtype, scales ``float32 [T, n]`` for fp8 else None).
    The fp8 scale is per token and per tap, computed one tap at a time (bounded fp32 temporaries).
    """
    _check_storage_dtype(storage_dtype)
    T = features.shape[0]
    x = features.reshape(T, num_taps, -1)
    if storage_dtype == "fp8":
        codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        scales = torch.empty((T, num_taps), dtype=torch.float32, device=x.device)
        for j in range(num_taps):
            codes[:, j], scales[:, j] = encode_fp8(x[:, j])
        return codes, scales
    return x.to(STORAGE_DTYPES[storage_dtype][1]).contiguous(), None


def decode_features(data: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Stored ``[T, n, D]`` (+ scales) -> ``[T, n*D]``; a zero-copy view for bf16/fp32 when ``dtype`` is None."""
    T = data.shape[0]
    if data.dtype == torch.float8_e4m3fn:
        return decode_fp8(data, scales, dtype or torch.bfloat16).reshape(T, -1)
    out = data.reshape(T, -1)
    return out if dtype is None else out.to(dtype)


# ----------------------------------------------------------------------------------------------
# Shard layout and writer
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRegion:
    name: str
    st_dtype: str
    shape: tuple[int, ...]
    start: int  # byte offset inside the data section
    nbytes: int


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class ShardLayout:
    """Header + byte regions of one shard, computed from the sample lengths alone.

    Data section order: sample_offsets, input_ids, loss_mask (known before extraction), features,
    scales (fp8; produced with the features).  ``_pad*`` U8 tensors keep features 64-byte and scales
    4-byte aligned (safetensors forbids holes, so padding is an explicit tensor of zeros).
    """

    def __init__(self, lengths: Sequence[int], num_taps: int, hidden_size: int, storage_dtype: str, metadata: dict[str, str]):
        _check_storage_dtype(storage_dtype)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if (self.lengths <= 0).any():
            raise ValueError("every sample must have at least one token")
        self.num_tokens = int(self.lengths.sum())
        self.num_taps, self.hidden_size, self.storage_dtype = num_taps, hidden_size, storage_dtype
        st_feat, _, per = STORAGE_DTYPES[storage_dtype]
        T, n, D = self.num_tokens, num_taps, hidden_size
        specs = [("sample_offsets", "I64", (len(self.lengths) + 1,), 8), ("input_ids", "I32", (T,), 4),
                 ("loss_mask", "U8", (T,), 1), ("features", st_feat, (T, n, D), 64)]
        if storage_dtype == "fp8":
            specs.append(("scales", "F32", (T, n), 4))
        item = {"I64": 8, "I32": 4, "U8": 1, "F32": 4, st_feat: per}
        self.regions: dict[str, TensorRegion] = {}
        pos = 0
        for name, st, shape, align in specs:
            if pos % align:
                pad = _align(pos, align) - pos
                self.regions[f"_pad{len(self.regions)}"] = TensorRegion(f"_pad{len(self.regions)}", "U8", (pad,), pos, pad)
                pos += pad
            nbytes = int(np.prod(shape)) * item[st]
            self.regions[name] = TensorRegion(name, st, shape, pos, nbytes)
            pos += nbytes
        self.data_bytes = pos
        header = {"__metadata__": {"format": FORMAT_VERSION, **metadata}}
        for r in self.regions.values():
            header[r.name] = {"dtype": r.st_dtype, "shape": list(r.shape), "data_offsets": [r.start, r.start + r.nbytes]}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (_align(8 + len(raw), 64) - 8 - len(raw))  # data section starts 64-byte aligned
        self.header_bytes = len(raw).to_bytes(8, "little") + raw
        self.data_start = len(self.header_bytes)
        self.total_bytes = self.data_start + self.data_bytes
        self.row_bytes = n * D * per  # bytes of one token's features

    def offset(self, name: str) -> int:
        """Absolute file offset of a region."""
        return self.data_start + self.regions[name].start

    def features_offset(self, token_start: int) -> int:
        """Absolute file offset of token ``token_start``'s feature row."""
        return self.offset("features") + token_start * self.row_bytes

    def scales_offset(self, token_start: int) -> int:
        """Absolute file offset of token ``token_start``'s fp8 scales (``num_taps`` float32)."""
        return self.offset("scales") + token_start * self.num_taps * 4


def pwrite_all(fd: int, buf, offset: int) -> None:
    """``os.pwrite`` until every byte of ``buf`` (any buffer) is written at ``offset``."""
    view = memoryview(buf).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _load_sync_file_range():
    """libc ``sync_file_range`` (Linux) through ctypes, which releases the GIL during the call; None elsewhere."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the dirty pages in the range, do not wait for it


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset+nbytes)`` to the device now (Linux; no-op elsewhere).

    Without it the freshly written pages sit in the page cache until the dirty-memory threshold (10% of
    RAM: ~13 GB on a 128 GB host, i.e. several shards) or the final ``fsync``: the disk idles while the
    first shards are computed and the fsync at shard close then has the whole backlog to write.  With it
    the disk is busy from the first batch on and ``fsync`` finds almost nothing left.  Advisory only:
    durability still comes from ``fsync`` in `ShardWriter.close`.
    """
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)  # an error here only loses the head start


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a numpy uint8 array (no copy when contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        raise ValueError("shard writes take CPU tensors")
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


class ShardWriter:
    """Writes one shard file in place: header + ids/mask/offsets at open, features by token offset.

    The file is pre-sized; ``write_tokens`` / ``pwrite`` may be called from several threads at once on
    disjoint tokens.  fp8 scales are kept in memory (``set_scales``) and written by ``close``.
    With ``stream_hash=True`` the caller feeds the feature bytes in token order to ``hash_features``
    (one thread) and ``close`` returns the file's sha256 without reading the file back.
    Use inside ``pipeline.stage_dir.AtomicFile`` so a killed writer never leaves a complete-looking shard.

    >>> with AtomicFile(final) as tmp:
    ...     w = ShardWriter(tmp, ids, input_ids, loss_masks, num_taps=5, hidden_size=D, storage_dtype="bfloat16")
    ...     w.write_tokens(0, data, scales); w.close()
    """

    def __init__(
        self,
        path: Path,
        ids: Sequence[str],
        input_ids: Sequence[np.ndarray],
        loss_masks: Sequence[np.ndarray],
        *,
        num_taps: int,
        hidden_size: int,
        storage_dtype: str,
        metadata: dict | None = None,
        stream_hash: bool = False,
    ):
        import hashlib

        if not (len(ids) == len(input_ids) == len(loss_masks)):
            raise ValueError("ids, input_ids and loss_masks must have one entry per sample")
        lengths = [len(x) for x in input_ids]
        for i, (a, m) in enumerate(zip(input_ids, loss_masks)):
            if len(a) != len(m):
                raise ValueError(f"sample {ids[i]!r}: {len(a)} input_ids but {len(m)} loss_mask entries")
        meta = {"ids": json.dumps(list(ids)), "num_taps": str(num_taps), "hidden_size": str(hidden_size),
                "storage_dtype": storage_dtype}
        meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()})
        L = self.layout = ShardLayout(lengths, num_taps, hidden_size, storage_dtype, meta)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        self.sample_offsets = offsets
        # everything before the features is known now: build it in memory, write it once
        prefix = bytearray(L.offset("features"))
        prefix[: L.data_start] = L.header_bytes
        for name, arr in (("sample_offsets", offsets),
                          ("input_ids", np.concatenate([np.asarray(a, np.int32) for a in input_ids]) if lengths else np.zeros(0, np.int32)),
                          ("loss_mask", np.concatenate([np.asarray(m, np.uint8) for m in loss_masks]) if lengths else np.zeros(0, np.uint8))):
            a = L.offset(name)
            prefix[a : a + arr.nbytes] = arr.tobytes()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(self.fd, L.total_bytes)
            pwrite_all(self.fd, prefix, 0)
        except OSError as e:
            raise with_path(e, self.path) from e
        self._scales = np.zeros((L.num_tokens, num_taps), np.float32) if storage_dtype == "fp8" else None
        self._scales_set = False
        self._sha = hashlib.sha256(prefix) if stream_hash else None
        self._hashed_bytes = 0
        self._io = threading.Condition()  # close() waits for in-flight pwrites: a closed fd number is never written
        self._inflight = 0

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens

    def pwrite(self, offset: int, raw) -> None:
        """Write raw bytes at an absolute file offset and start their writeback (`start_writeback`).
        Thread-safe; refused once the writer is closed."""
        with self._io:
            if self.fd < 0:
                raise ValueError(f"{self.path}: write after close")
            self._inflight += 1
        try:
            pwrite_all(self.fd, raw, offset)
            start_writeback(self.fd, offset, memoryview(raw).nbytes)
        except OSError as e:  # ENOSPC, EIO: name the shard
            raise with_path(e, self.path) from e
        finally:
            with self._io:
                self._inflight -= 1
                self._io.notify_all()

    def set_scales(self, token_start: int, scales: torch.Tensor) -> None:
        """fp8: remember scales ``[T, n]`` of tokens ``token_start..``; ``close`` writes them."""
        s = scales.detach().float().cpu().numpy()
        self._scales[token_start : token_start + len(s)] = s
        self._scales_set = True

    def write_tokens(self, token_start: int, data: torch.Tensor, scales: torch.Tensor | None = None) -> None:
        """Write encoded features of tokens ``token_start .. token_start+T`` (``data [T, n, D]`` in the storage
        dtype, ``scales [T, n]`` for fp8; CPU tensors, e.g. pinned buffers).  Thread-safe."""
        L = self.layout
        T = data.shape[0]
        if token_start < 0 or token_start + T > L.num_tokens:
            raise ValueError(f"tokens {token_start}..{token_start + T} outside the shard's {L.num_tokens}")
        if data.dtype != STORAGE_DTYPES[L.storage_dtype][1] or data[0].numel() != L.num_taps * L.hidden_size:
            raise ValueError(f"features must be [T, {L.num_taps}, {L.hidden_size}] {L.storage_dtype}, got {tuple(data.shape)} {data.dtype}")
        if L.storage_dtype == "fp8":
            if scales is None or scales.shape[0] != T:
                raise ValueError("fp8 storage needs a [T, n] scales tensor with every write")
            self.set_scales(token_start, scales)
        self.pwrite(L.features_offset(token_start), as_bytes(data))

    def write_sample(self, i: int, features: torch.Tensor) -> None:
        """Encode and write sample ``i``'s features ``[S_i, n*D]`` (any float dtype, CPU)."""
        data, scales = encode_features(features.cpu(), self.layout.num_taps, self.layout.storage_dtype)
        self.write_tokens(int(self.sample_offsets[i]), data, scales)

    def hash_features(self, raw) -> None:
        """Feed the next feature bytes, in token order, to the streaming sha256 (one thread only)."""
        if self._sha is not None:
            self._sha.update(raw)
            self._hashed_bytes += memoryview(raw).nbytes

    def close(self) -> str | None:
        """Write fp8 scales, fsync, close.  Returns the file's sha256 when it was streamed completely."""
        with self._io:
            if self.fd < 0:
                return None
            while self._inflight:
                self._io.wait()
            fd, self.fd = self.fd, -1  # later pwrite calls are refused
        L = self.layout
        tail = b""
        if self._scales is not None and self._scales_set:
            tail_start = L.offset("features") + L.regions["features"].nbytes
            tail = bytes(L.offset("scales") - tail_start) + self._scales.tobytes()
        try:
            if tail:
                pwrite_all(fd, tail, tail_start)
            os.fsync(fd)
        except OSError as e:
            raise with_path(e, self.path) from e
        finally:
            os.close(fd)
        if self._sha is None or self._hashed_bytes != L.regions["features"].nbytes:
            return None
        if self._scales is not None:
            if not self._scales_set:
                return None
            self._sha.update(tail)
        return self._sha.hexdigest()

    def __del__(self):
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def read_shard_header(path: Path) -> tuple[dict, int]:
    """(safetensors header dict, absolute offset of the data section) of a shard whose header parses and whose
    regions end exactly at the end of the file (a truncated or extended shard is refused here, never reshaped)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n <= 0 or n > 100 << 20:
            raise StageError(f"{path}: not a feature shard (header length {n})")
        raw = f.read(n)
        size = os.fstat(f.fileno()).st_size
    try:
        header = json.loads(raw)
        meta = header.get("__metadata__", {})
        end = max((spec["data_offsets"][1] for name, spec in header.items() if name != "__metadata__"), default=0)
    except (ValueError, AttributeError, KeyError, TypeError, IndexError) as e:
        raise StageError(f"{path}: damaged shard header ({type(e).__name__}: {e})") from e
    if meta.get("format") != FORMAT_VERSION:
        raise StageError(f"{path}: format {meta.get('format')!r}, this code reads {FORMAT_VERSION!r}")
    if 8 + n + end != size:
        raise StageError(f"{path}: {size} bytes, its header describes {8 + n + end} (truncated or damaged)")
    return header, 8 + n


class Shard:
    """One memory-mapped shard; every tensor is a zero-copy view of the file (read-only: do not write)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.header, data_start = read_shard_header(self.path)
        meta = self.header["__metadata__"]
        self.ids: list[str] = json.loads(meta["ids"])
        self.rows: list[int] | None = json.loads(meta["rows"]) if "rows" in meta else None
        self.num_taps, self.hidden_size = int(meta["num_taps"]), int(meta["hidden_size"])
        self.storage_dtype = meta["storage_dtype"]
        mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.tensors: dict[str, torch.Tensor] = {}
        with warnings.catch_warnings():  # torch warns that the mapping is read-only; it is, on purpose
            warnings.simplefilter("ignore", UserWarning)
            for name, spec in self.header.items():
                if name == "__metadata__":
                    continue
                dtype, _ = _ST_DTYPES[spec["dtype"]]
                a, b = spec["data_offsets"]
                raw = torch.from_numpy(mm[data_start + a : data_start + b])
                self.tensors[name] = raw.view(dtype).reshape(spec["shape"])
        self.offsets = self.tensors["sample_offsets"].numpy()

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sample(self, row: int, dtype: torch.dtype | None = None) -> dict:
        """Sample ``row`` of this shard: ids, mask and features ``[S, n*D]`` (a view unless fp8/``dtype``)."""
        a, b = int(self.offsets[row]), int(self.offsets[row + 1])
        scales = self.tensors["scales"][a:b] if "scales" in self.tensors else None
        return {
            "id": self.ids[row],
            "input_ids": self.tensors["input_ids"][a:b].long(),
            "loss_mask": self.tensors["loss_mask"][a:b].bool(),
            "features": decode_features(self.tensors["features"][a:b], scales, dtype),
        }


class FeatureReader:
    """Random access to a finished extraction (the ``extract`` stage directory).

    >>> reader = FeatureReader("runs/tiny/extract")
    >>> reader.fingerprint["layer_ids"], len(reader), reader.lengths[:3]
    >>> s = reader.sample(0)   # {"id", "input_ids" Long[S], "loss_mask" Bool[S], "features" [S, n*D]}

    Features are zero-copy views of the memory-mapped shard for bf16/fp32 storage; fp8 is dequantized
    to ``fp8_dtype`` (bf16 by default).  Pass ``dtype`` to ``sample`` to get a converted copy instead.
    Shards are opened lazily, so a reader can be created before DataLoader workers fork.

    With ``check`` (the default) nothing damaged is ever served: opening the reader checks the index and every
    shard's size and header (`check_store` without hashing), and a shard's sha256 is verified when it is first
    opened in this process (`verify_shard_sha256`); each failure is a StageError naming the file and the fix.
    """

    def __init__(self, path: str | Path, *, fp8_dtype: torch.dtype = torch.bfloat16, check: bool = True):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not manifest_path.exists():
            raise StageError(f"{self.path} has no {MANIFEST}: the extraction is not finished (run `drafter extract`, "
                             "or `drafter extract --merge` after a split run)")
        self.manifest = read_store_manifest(self.path)
        self.fingerprint: dict = self.manifest["fingerprint"]
        self.fp8_dtype = fp8_dtype
        self.shard_names: list[str] = list(self.manifest["storage"]["shards"])
        self.check = check
        if check:
            problems = check_store(self.path, full=False)
            if problems:
                raise damaged(self.path, problems)
        index = read_index(self.path / INDEX_FILE)
        self.ids: list[str] = index["id"]
        self.shard_of: np.ndarray = index["shard"]
        self.row_of: np.ndarray = index["row"]
        self.lengths: np.ndarray = index["length"]
        self.num_loss_tokens: np.ndarray = index["num_loss_tokens"]
        self._shards: dict[int, Shard] = {}

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def layer_ids(self) -> list[int]:
        return list(self.fingerprint["layer_ids"])

    @property
    def feature_dim(self) -> int:
        """stored taps * hidden_size: the width of ``sample(i)["features"]`` (`stored_taps`)."""
        return stored_taps(self.fingerprint) * int(self.fingerprint["hidden_size"])

    def shard(self, k: int) -> Shard:
        """Shard ``k``, opened on first use; with ``check`` its sha256 is verified first (`verify_shard_sha256`)."""
        if k not in self._shards:
            path = self.path / "shards" / self.shard_names[k]
            if self.check:
                verify_shard_sha256(path, self._expected_sha256(path.name))
            self._shards[k] = Shard(path)
        return self._shards[k]

    def _expected_sha256(self, name: str) -> str:
        return next(f["sha256"] for f in self.manifest["files"] if f["name"] == name)

    def verify_shards_in_background(self) -> threading.Thread:
        """Hash every shard on a daemon thread, off the critical path, before a reader needs it: DataLoader workers
        forked afterwards find it verified (the record is per process and inherited by fork); a shard a reader
        needs sooner is hashed by that reader. A mismatch is raised by the first open of that shard."""

        def run():
            for name in self.shard_names:
                try:
                    verify_shard_sha256(self.path / "shards" / name, self._expected_sha256(name))
                except StageError:
                    pass  # recorded: the open of this shard raises it, in this process and in forked workers

        thread = threading.Thread(target=run, name="verify-shards", daemon=True)
        thread.start()
        return thread

    def sample(self, i: int, dtype: torch.dtype | None = None) -> dict:
        """Sample ``i`` (index order = tokenize order): {"id", "input_ids", "loss_mask", "features" [S, n*D]}."""
        if not 0 <= i < len(self.ids):
            raise IndexError(f"sample {i} out of range 0..{len(self.ids) - 1}")
        shard = self.shard(int(self.shard_of[i]))
        out = shard.sample(int(self.row_of[i]), dtype if dtype is not None else
                           (self.fp8_dtype if shard.storage_dtype == "fp8" else None))
        return out

    def __getitem__(self, i: int) -> dict:
        return self.sample(i)


# ----------------------------------------------------------------------------------------------
# Index
# ----------------------------------------------------------------------------------------------

INDEX_COLUMNS = ("id", "shard", "row", "token_offset", "length", "num_loss_tokens", "source_row")


def build_index(shard_paths: Sequence[Path]) -> dict[str, list]:
    """Index columns from the shards' headers (no feature bytes are read), sorted by source row."""
    cols: dict[str, list] = {c: [] for c in INDEX_COLUMNS}
    for k, p in enumerate(shard_paths):
        sh = Shard(p)
        lengths = sh.lengths
        mask = sh.tensors["loss_mask"].numpy()
        loss = np.add.reduceat(mask.astype(np.int64), sh.offsets[:-1]) if len(sh) else np.zeros(0, np.int64)
        rows = sh.rows if sh.rows is not None else [-1] * len(sh)
        for r in range(len(sh)):
            cols["id"].append(sh.ids[r])
            cols["shard"].append(k)
            cols["row"].append(r)
            cols["token_offset"].append(int(sh.offsets[r]))
            cols["length"].append(int(lengths[r]))
            cols["num_loss_tokens"].append(int(loss[r]))
            cols["source_row"].append(int(rows[r]))
    order = sorted(range(len(cols["id"])), key=lambda i: (cols["source_row"][i], cols["shard"][i], cols["row"][i]))
    return {c: [v[i] for i in order] for c, v in cols.items()}


def write_index(path: Path, cols: dict[str, list]) -> None:
    """Write the index as parquet, atomically."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.files import atomic_write_bytes

    table = pa.table({
        "id": pa.array(cols["id"], pa.string()),
        "shard": pa.array(cols["shard"], pa.int32()),
        "row": pa.array(cols["row"], pa.int32()),
        "token_offset": pa.array(cols["token_offset"], pa.int64()),
        "length": pa.array(cols["length"], pa.int32()),
        "num_loss_tokens": pa.array(cols["num_loss_tokens"], pa.int32()),
        "source_row": pa.array(cols["source_row"], pa.int64()),
    })
    buf = io.BytesIO()
    pq.write_table(table, buf)
    atomic_write_bytes(path, buf.getvalue())


def read_index(path: Path) -> dict:
    """The index as numpy arrays (``id`` as a list of str)."""
    import pyarrow.parquet as pq

    if not Path(path).exists():
        raise StageError(f"{path} is missing: {REPAIR} rebuilds it")
    t = pq.read_table(path)
    out = {c: t.column(c).to_numpy().astype(np.int64) for c in INDEX_COLUMNS if c != "id"}
    out["id"] = t.column("id").to_pylist()
    return out


# ----------------------------------------------------------------------------------------------
# Checksums
# ----------------------------------------------------------------------------------------------


REPAIR = "run `drafter extract --repair` with this run's config (it re-extracts only the damaged shards)"

# (path, size, mtime_ns) -> None when the sha256 matched, else the problem: per process, inherited by forked workers
_SHA256_CHECKED: dict[tuple[str, int, int], str | None] = {}
_SHA256_LOCK = threading.Lock()  # one hash per shard per process, whichever thread asks first


def _fresh_lock_after_fork() -> None:
    """A worker forked while another thread hashed would inherit the lock held forever: give it its own."""
    global _SHA256_LOCK
    _SHA256_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_after_fork)


def verify_shard_sha256(path: Path, expected: str) -> None:
    """Stream the shard through sha256 once per process (a later call, or a forked worker, reuses the result) and
    raise a StageError naming the shard and the fix when it differs from ``expected`` (the manifest's)."""
    st = os.stat(path)
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _SHA256_CHECKED:
        with _SHA256_LOCK:
            if key not in _SHA256_CHECKED:
                bad = sha256_file(path) != expected
                _SHA256_CHECKED[key] = f"{path}: sha256 differs from the manifest (corrupted)" if bad else None
    if _SHA256_CHECKED[key] is not None:
        raise StageError(f"{_SHA256_CHECKED[key]}; {REPAIR}")


def damaged(path: Path, problems: dict[Path, str]) -> StageError:
    """The one error for an extraction whose files fail their checks: every problem, then the fix."""
    lines = [f"{p}: {why}" for p, why in problems.items()]
    shown = "\n  ".join(lines[:10]) + (f"\n  ... and {len(lines) - 10} more" if len(lines) > 10 else "")
    return StageError(f"the features at {path} are damaged:\n  {shown}\n{REPAIR}")


def check_store(path: str | Path, *, full: bool = True) -> dict[Path, str]:
    """What is wrong with each file of a finished extraction that fails its checks (empty when all is well).

    Every file listed in the manifest: present, the recorded size; a shard's header parses, its regions end at
    the end of the file and its tap layout is the manifest's; with ``full`` also the sha256 (reads every byte).
    """
    path = Path(path)
    manifest = read_store_manifest(path)
    problems: dict[Path, str] = {}
    fp = manifest["fingerprint"]
    layout = (stored_taps(fp), int(fp["hidden_size"]), fp["storage_dtype"])
    entries = [(path / "shards" / f["name"], f) for f in manifest["files"] if not f["name"].endswith(".json")]
    if manifest["storage"].get("index") is not None:
        entries.append((path / INDEX_FILE, manifest["storage"]["index"]))
    for p, f in entries:
        if not p.exists():
            problems[p] = "missing"
        elif p.stat().st_size != f["bytes"]:
            problems[p] = f"{p.stat().st_size} bytes, the manifest says {f['bytes']} (truncated or damaged)"
        elif full and sha256_file(p) != f["sha256"]:
            problems[p] = "sha256 differs from the manifest (corrupted)"
        elif p.suffix == f".{SHARD_EXT}":
            try:
                meta = read_shard_header(p)[0]["__metadata__"]
                got = (int(meta["num_taps"]), int(meta["hidden_size"]), meta["storage_dtype"])
            except (StageError, KeyError, ValueError) as e:
                problems[p] = str(e).removeprefix(f"{p}: ")
                continue
            if got != layout:
                problems[p] = f"holds (taps, hidden, dtype) {got}, the manifest says {layout}"
    return problems


# ----------------------------------------------------------------------------------------------
# Finishing a store
# ----------------------------------------------------------------------------------------------


def finalize_store(
    stage,
    *,
    shard_names: Sequence[str],
    config_hash: str,
    fingerprint: dict,
    started: float,
    inputs: dict | None = None,
    counts: dict | None = None,
    extra: dict | None = None,
) -> dict:
    """Write ``index.parquet`` from the shards' headers, then the manifest (last: it marks completion).

    ``stage`` is a `pipeline.stage_dir.StageDir` whose units (one per shard) are all finished.
    """
    from pipeline.files import sha256_file as _sha

    cols = build_index([stage.shards / n for n in shard_names])
    ids = cols["id"]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise StageError(f"sample id {dup!r} appears in more than one shard: the units overlap")
    index_path = stage.path / INDEX_FILE
    write_index(index_path, cols)
    storage = {
        "format": FORMAT_VERSION,
        "shards": list(shard_names),
        "index": {"name": INDEX_FILE, "bytes": index_path.stat().st_size, "sha256": _sha(index_path)},
        "num_samples": len(ids),
        "num_tokens": int(sum(cols["length"])),
        "bytes_per_token": bytes_per_token(stored_taps(fingerprint), int(fingerprint["hidden_size"]),
                                           fingerprint["storage_dtype"]),
    }
    return stage.write_manifest(config_hash=config_hash, fingerprint=fingerprint, inputs=inputs, counts=counts,
                                started=started, extra={"storage": storage, **(extra or {})})


def write_feature_store(
    path: str | Path,
    samples: Sequence[dict],
    *,
    fingerprint: dict,
    shard_tokens: int = 1 << 20,
) -> Path:
    """Write in-memory samples as a finished extraction that `FeatureReader` opens (tests, small tools).

    ``samples``: dicts with "id", "input_ids" [S], "loss_mask" [S], "features" [S, n*D] (any float dtype;
    n = `stored_taps(fingerprint)`). ``fingerprint`` needs at least "layer_ids", "hidden_size" and "storage_dtype".
    Samples are cut into shards of about ``shard_tokens`` tokens in the given order.
    """
    import time

    from pipeline.files import AtomicFile
    from pipeline.stage_dir import StageDir

    path = Path(path)
    stage = StageDir(path.parent, path.name)
    started = time.time()
    stage.begin("write_feature_store", force=True)
    n, D, sd = stored_taps(fingerprint), int(fingerprint["hidden_size"]), fingerprint["storage_dtype"]
    groups, cur, tok = [], [], 0
    for i, s in enumerate(samples):
        cur.append(i)
        tok += len(s["input_ids"])
        if tok >= shard_tokens:
            groups.append(cur)
            cur, tok = [], 0
    if cur:
        groups.append(cur)
    names = []
    for k, group in enumerate(groups):
        unit = f"{k:05d}"
        final = stage.shard_path(unit, SHARD_EXT)
        with AtomicFile(final) as tmp:
            w = ShardWriter(tmp, [samples[i]["id"] for i in group],
                            [np.asarray(samples[i]["input_ids"], dtype=np.int32) for i in group],
                            [np.asarray(samples[i]["loss_mask"], dtype=np.uint8) for i in group],
                            num_taps=n, hidden_size=D, storage_dtype=sd, metadata={"rows": group})
            for r, i in enumerate(group):
                w.write_sample(r, torch.as_tensor(samples[i]["features"]))
            w.close()
        stage.finish_unit(unit, [final], samples=len(group))
        names.append(final.name)
    finalize_store(stage, shard_names=names, config_hash="write_feature_store", fingerprint=fingerprint,
                   started=started, counts={"written": len(samples)})
    return path
