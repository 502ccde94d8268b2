"""Stream uint8 shards to the device through a bounded window of memory, in an order that is a
pure function of (seed, epoch, shard counts): an epoch resumed at step k skips the windows before
it unread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import io
import logging
import mmap
import os
import queue
import shutil
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from burstcv_spec import storage

log = logging.getLogger(__name__)

SHARD_CACHE_ENV = "BURSTCV_SHARD_CACHE_DIR"  # the training box sets it to a folder on its disk
CACHE_RESERVE_BYTES = 2 * 2**30  # disk the cache always leaves free (logs, checkpoints, pip)
MAX_SLOTS = 3  # a window of 2 shards + 1 prefetched: more buys nothing once loading keeps up
READ_CHUNK = 1 << 16  # bytes per read of image data: small blocks that malloc recycles
EVAL_BATCH = 1024  # images per evaluation batch (no gradients: memory is the activations)


class JobSpecError(ValueError):
    """Raise when job.json and its shards disagree (classes, shapes, missing files)."""


@dataclass(frozen=True)
class ShardInfo:
    """Describe one shard from its headers: where it is, how many images, what size."""

    uri: str
    count: int
    height: int
    width: int

    @property
    def nbytes(self) -> int:
        """Return the memory the decoded shard takes: uint8 HxWx3 images + int64 labels."""
        return self.count * (self.height * self.width * 3 + 8)


class _S3RangeReader(io.RawIOBase):
    """Read an S3 object by byte ranges, so zipfile can parse a shard's headers unread."""

    def __init__(self, uri: str) -> None:
        self._bucket, self._key = storage._split_s3(uri)
        self._client = storage.s3_client()
        self._size = _object_size(uri)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        end = min(self._pos + len(view), self._size)
        if end <= self._pos:
            return 0
        body = self._client.get_object(
            Bucket=self._bucket, Key=self._key, Range=f"bytes={self._pos}-{end - 1}"
        )["Body"].read()
        view[: len(body)] = body
        self._pos += len(body)
        return len(body)


@contextmanager
def _open_zip(path: str, uri: str | None = None) -> Iterator[zipfile.ZipFile]:
    """Open the shard at ``path`` (a local file or s3://) as a zip; errors name ``uri``."""
    uri = uri or path
    try:
        if storage.is_s3(path):  # a missing object raises JobSpecError here
            raw: IO[bytes] = io.BufferedReader(_S3RangeReader(path), buffer_size=1 << 16)
        else:
            raw = open(storage.local_path(path), "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError as exc:
        raise JobSpecError(f"missing shard {uri}") from exc
    try:
        with zipfile.ZipFile(raw) as zf:
            yield zf
    except zipfile.BadZipFile as exc:
        raise JobSpecError(f"shard {uri} is not an .npz file ({exc})") from exc
    finally:
        raw.close()


def _member(zf: zipfile.ZipFile, uri: str, name: str) -> IO[bytes]:
    try:
        return zf.open(f"{name}.npy")
    except KeyError as exc:
        raise JobSpecError(f"shard {uri} has no '{name}' array") from exc


def _check_labels(uri: str, labels: np.ndarray, count: int, num_classes: int) -> None:
    if len(labels) != count or (len(labels) and (labels.min() < 0 or labels.max() >= num_classes)):
        raise JobSpecError(f"shard {uri} has labels outside 0..{num_classes - 1}")


def _array_header(fp: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    fmt = np.lib.format
    read = fmt.read_array_header_1_0 if fmt.read_magic(fp) == (1, 0) else fmt.read_array_header_2_0
    shape, fortran, dtype = read(fp)
    return tuple(shape), bool(fortran), dtype


def _read_images(
    fp: IO[bytes], uri: str, shape: tuple[int, ...], fortran: bool, dtype: np.dtype[Any]
) -> np.ndarray:
    """Read an array's data into fresh anonymous memory, returned to the OS when it is freed
    (shard-sized malloc buffers raise glibc's mmap threshold, then fragment its heap for good)."""
    count = int(np.prod(shape))
    nbytes = count * dtype.itemsize
    buffer = mmap.mmap(-1, max(1, nbytes))
    with memoryview(buffer) as view:
        done = 0
        while done < nbytes:
            n = fp.readinto(view[done : done + READ_CHUNK])  # type: ignore[attr-defined]
            if not n:
                raise JobSpecError(f"shard {uri} is truncated ({done} of {nbytes} image bytes)")
            done += n
    images = np.frombuffer(buffer, dtype=dtype, count=count)
    return images.reshape(shape[::-1]).T if fortran else images.reshape(shape)


def _read_shard(
    zf: zipfile.ZipFile, uri: str, classes: list[str], *, with_images: bool
) -> tuple[ShardInfo, np.ndarray | None, np.ndarray]:
    with _member(zf, uri, "classes") as fp:
        shard_classes = [str(c) for c in np.lib.format.read_array(fp, allow_pickle=False)]
    if shard_classes != classes:
        raise JobSpecError(
            f"shard {uri} was packed for classes {shard_classes}, the job names {classes}"
        )
    with _member(zf, uri, "labels") as fp:
        labels = np.lib.format.read_array(fp, allow_pickle=False).astype(np.int64)
    if "jpeg.npy" in zf.namelist():
        return _read_jpeg_shard(zf, uri, labels, len(classes), with_images=with_images)
    with _member(zf, uri, "images") as fp:
        shape, fortran, dtype = _array_header(fp)
        if dtype != np.uint8 or len(shape) != 4 or shape[-1] != 3:
            raise JobSpecError(f"shard {uri} holds {dtype} {shape}, not uint8 NxHxWx3")
        _check_labels(uri, labels, shape[0], len(classes))
        images = _read_images(fp, uri, shape, fortran, dtype) if with_images else None
    info = ShardInfo(uri=uri, count=int(shape[0]), height=int(shape[1]), width=int(shape[2]))
    return info, images, labels


def _read_jpeg_shard(
    zf: zipfile.ZipFile, uri: str, labels: np.ndarray, num_classes: int, *, with_images: bool
) -> tuple[ShardInfo, np.ndarray | None, np.ndarray]:
    """Read a JPEG shard (pack's shard_format jpeg): its images decoded to uint8 NxHxWx3."""
    with _member(zf, uri, "shape") as fp:
        shape = tuple(int(v) for v in np.lib.format.read_array(fp, allow_pickle=False))
    with _member(zf, uri, "offsets") as fp:
        offsets = np.lib.format.read_array(fp, allow_pickle=False).astype(np.int64)
    count = len(offsets) - 1
    if len(shape) != 3 or shape[2] != 3 or count < 0 or bool((np.diff(offsets) <= 0).any()):
        raise JobSpecError(f"shard {uri} is not a JPEG shard (shape {shape}, {count} offsets)")
    _check_labels(uri, labels, count, num_classes)
    info = ShardInfo(uri=uri, count=count, height=shape[0], width=shape[1])
    if not with_images:
        return info, None, labels
    with _member(zf, uri, "jpeg") as fp:
        data = np.lib.format.read_array(fp, allow_pickle=False)
    if data.dtype != np.uint8 or len(data) != int(offsets[-1]):
        raise JobSpecError(f"shard {uri} is truncated ({len(data)} of {offsets[-1]} JPEG bytes)")
    return info, decode_jpegs(data, offsets, shape, uri), labels


def decode_jpegs(
    data: np.ndarray, offsets: np.ndarray, shape: tuple[int, ...], uri: str
) -> np.ndarray:
    """Decode a JPEG shard into fresh anonymous memory (as ``_read_images``) on parallel threads."""
    from PIL import Image

    count = len(offsets) - 1
    buffer = mmap.mmap(-1, max(1, count * int(np.prod(shape))))
    images = np.frombuffer(buffer, dtype=np.uint8, count=count * int(np.prod(shape)))
    images = images.reshape((count, *shape))
    view = data.data  # a memoryview: each file is sliced out uncopied

    def decode(i: int) -> None:
        try:
            with Image.open(io.BytesIO(view[offsets[i] : offsets[i + 1]])) as img:
                decoded = np.asarray(img.convert("RGB"))
        except (OSError, ValueError) as exc:
            raise JobSpecError(f"shard {uri}: image {i} is not a decodable JPEG ({exc})") from exc
        if decoded.shape != shape:
            raise JobSpecError(f"shard {uri}: image {i} is {decoded.shape}, not {shape}")
        images[i] = decoded

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        list(pool.map(decode, range(count)))
    return images


def read_shard_info(uri: str, classes: list[str]) -> ShardInfo:
    """Validate a shard from its headers, classes and labels, leaving its images unread."""
    with _open_zip(uri) as zf:
        return _read_shard(zf, uri, classes, with_images=False)[0]


class ShardCache:
    """Keep the S3 shards a box has downloaded on its own disk, for the epochs after the first;
    once free space would drop below ``reserve_bytes`` it takes nothing more, and the shards it
    lacks are downloaded each epoch into a temporary file in its folder (not a RAM /tmp)."""

    def __init__(self, root: str | Path, *, reserve_bytes: int = CACHE_RESERVE_BYTES) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.reserve_bytes = reserve_bytes
        self.full, self.hits, self.downloads = False, 0, 0
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, run_id: str) -> ShardCache | None:
        """Return the cache of ``run_id`` under $BURSTCV_SHARD_CACHE_DIR, or None if unset."""
        root = os.environ.get(SHARD_CACHE_ENV)
        return cls(Path(root) / run_id) if root else None

    def path(self, uri: str) -> Path:
        """Return where the cached copy of ``uri`` lives (whether or not it is there yet)."""
        digest = hashlib.sha256(uri.encode()).hexdigest()[:32]
        return self.root / f"{digest}.npz"

    def local_copy(self, uri: str) -> Path | None:
        """Return a local copy of S3 shard ``uri``, downloading it once; None if it won't fit."""
        cached = self.path(uri)
        if cached.exists():
            with self._lock:
                self.hits += 1
            return cached
        if self.full:
            return None
        if shutil.disk_usage(self.root).free - _object_size(uri) < self.reserve_bytes:
            log.warning(
                "shard cache %s: the disk has less than %.1f GB free beyond this shard; "
                "shards not cached by now are downloaded again every epoch",
                self.root,
                self.reserve_bytes / 2**30,
            )
            self.full = True
            return None
        partial = cached.with_name(f"{cached.name}.{os.getpid()}.{threading.get_ident()}.part")
        try:
            storage.download_file(uri, partial)
            os.replace(partial, cached)  # atomic: readers see the whole file or none
        finally:
            partial.unlink(missing_ok=True)
        with self._lock:
            self.downloads += 1
        return cached

    def clear(self) -> None:
        """Delete the cached shards (the job is over)."""
        shutil.rmtree(self.root, ignore_errors=True)


def _object_size(uri: str) -> int:
    """Return the size of S3 object ``uri``; a missing one is a missing shard."""
    bucket, key = storage._split_s3(uri)
    client = storage.s3_client()
    try:
        return int(client.head_object(Bucket=bucket, Key=key)["ContentLength"])
    except client.exceptions.ClientError as exc:
        raise JobSpecError(f"missing shard {uri}") from exc


def load_shard(
    uri: str, classes: list[str], cache: ShardCache | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Read one shard whole (uint8 NHWC images, int64 labels), validated like its headers; an S3
    shard goes through a file (``cache`` or temporary): bytes and arrays never both in RAM."""
    if not storage.is_s3(uri):
        return _load_local(uri, uri, classes)
    if cache is not None:
        local_copy = cache.local_copy(uri)
        if local_copy is not None:
            return _load_local(str(local_copy), uri, classes)
    if not storage.exists(uri):
        raise JobSpecError(f"missing shard {uri}")
    scratch = str(cache.root) if cache is not None else None
    with tempfile.TemporaryDirectory(prefix="burstcv-shard-", dir=scratch) as tmp:
        local = Path(tmp) / "shard.npz"
        storage.download_file(uri, local)
        return _load_local(str(local), uri, classes)


def _load_local(path: str, uri: str, classes: list[str]) -> tuple[np.ndarray, np.ndarray]:
    with _open_zip(path, uri) as zf:
        _, images, labels = _read_shard(zf, uri, classes, with_images=True)
    assert images is not None
    return images, labels


def _rng(seed: int, *keys: int) -> np.random.Generator:
    # SeedSequence wants non-negative entropy; a job's seed may be any int.
    return np.random.default_rng(np.random.SeedSequence([seed % 2**63, *keys]))


def epoch_windows(counts: list[int], seed: int, epoch: int, mix: int) -> list[list[int]]:
    """Return the shard indices of each window of an epoch: shards shuffled, ``mix`` a window."""
    order = _rng(seed, epoch, 0).permutation(len(counts)).tolist()
    return [order[i : i + mix] for i in range(0, len(order), mix)]


def node_shards(counts: list[int], nodes: int) -> list[list[int]]:
    """Deal a split's shards to ``nodes`` boxes, their images as even as whole shards allow:
    largest first, each to the box with the fewest images so far. It follows from the sizes
    alone, so it is the same on every box, in every epoch and after a relaunch."""
    if not 1 <= nodes <= len(counts):
        raise ValueError(f"cannot deal {len(counts)} shard(s) to {nodes} box(es)")
    deal: list[list[int]] = [[] for _ in range(nodes)]
    held = [0] * nodes
    for shard in sorted(range(len(counts)), key=lambda i: (-counts[i], i)):
        box = min(range(nodes), key=lambda b: (held[b], b))
        deal[box].append(shard)
        held[box] += counts[shard]
    return [sorted(part) for part in deal]


def window_order(size: int, seed: int, epoch: int, window: int) -> np.ndarray:
    """Return the shuffled order of a window's ``size`` images (its own stream: skippable)."""
    return _rng(seed, epoch, 1 + window).permutation(size)


def plan_slots(shard_bytes: int, budget_bytes: int) -> tuple[int, int]:
    """Return (mix, prefetch): shards per window and shards loaded ahead, within the budget."""
    slots = max(1, min(MAX_SLOTS, budget_bytes // max(1, shard_bytes)))
    if budget_bytes < shard_bytes:
        log.warning(
            "one shard takes %.0f MB, more than the data memory budget of %.0f MB: "
            "pack with smaller shards to stay within it",
            shard_bytes / 2**20,
            budget_bytes / 2**20,
        )
    mix = 2 if slots >= 3 else 1
    return mix, slots - mix


_DONE = object()


def _load_malloc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_MALLOC_TRIM = _load_malloc_trim()


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc): else resident memory creeps up."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class _Prefetcher:
    """Load shards in a background thread, at most ``slots`` alive (``get`` then ``release``)."""

    def __init__(
        self, uris: list[str], classes: list[str], slots: int, cache: ShardCache | None = None
    ) -> None:
        self._uris = uris
        self._classes = classes
        self._cache = cache
        self._free = threading.Semaphore(slots)
        self._ready: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shard-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for uri in self._uris:
                while not self._free.acquire(timeout=0.1):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                self._ready.put(load_shard(uri, self._classes, self._cache))
            self._ready.put(_DONE)
        except BaseException as exc:  # handed to the consumer, which raises it
            self._ready.put(exc)

    def get(self) -> tuple[np.ndarray, np.ndarray]:
        """Return the next shard's (images, labels), waiting for it; raise what loading raised."""
        item = self._ready.get()
        if isinstance(item, BaseException):
            raise item
        if item is _DONE:
            raise RuntimeError("the prefetch thread has no more shards")
        images, labels = item
        return images, labels

    def release(self) -> None:
        """Free the slot of one consumed shard."""
        self._free.release()

    def close(self) -> None:
        """Stop the thread (it exits at its next slot wait) and drop what it loaded."""
        self._stop.set()
        self._thread.join(timeout=60)
        while not self._ready.empty():
            self._ready.get_nowait()


class _DeviceCopier:
    """Copy uint8 NHWC batches to the device as NCHW, through two alternating pinned buffers
    on CUDA (one is filled while the other's copy may still be in flight)."""

    def __init__(
        self, device: torch.device, on_wait: Callable[[float], None] | None = None
    ) -> None:
        self.device = device
        self._on_wait = on_wait  # told the seconds spent waiting on the GPU for a free buffer
        self._pinned = device.type == "cuda"
        self._buffers: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
        self._turn = 0

    def __call__(self, images: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = torch.from_numpy(images), torch.from_numpy(labels)
        if not self._pinned:
            return x.permute(0, 3, 1, 2).to(self.device), y.to(self.device)
        if len(self._buffers) < 2:
            self._buffers.append((_pinned_like(x), _pinned_like(y), torch.cuda.Event()))
        host_x, host_y, done = self._buffers[self._turn % len(self._buffers)]
        self._turn += 1
        waited = time.perf_counter()
        done.synchronize()  # the copy that last read this buffer has finished
        if self._on_wait is not None:  # the copy queued behind the GPU's steps: GPU time
            self._on_wait(time.perf_counter() - waited)
        if host_x.shape[0] < x.shape[0] or host_x.shape[1:] != x.shape[1:]:
            host_x, host_y = _pinned_like(x), _pinned_like(y)
            self._buffers[(self._turn - 1) % len(self._buffers)] = (host_x, host_y, done)
        n = x.shape[0]
        host_x[:n].copy_(x)
        host_y[:n].copy_(y)
        dev_x = host_x[:n].to(self.device, non_blocking=True)
        dev_y = host_y[:n].to(self.device, non_blocking=True)
        done.record()
        # NHWC memory seen as NCHW is channels_last, the layout the CUDA loop wants anyway.
        return dev_x.permute(0, 3, 1, 2), dev_y


def _pinned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype).pin_memory()


def _gather(
    shards: list[tuple[np.ndarray, np.ndarray]], offsets: list[int], rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Return the images and labels at window positions ``rows`` (in that order)."""
    first = shards[0][0]
    images = np.empty((len(rows), *first.shape[1:]), dtype=first.dtype)
    labels = np.empty(len(rows), dtype=np.int64)
    for (shard_images, shard_labels), start in zip(shards, offsets, strict=True):
        # Integer positions and np.take: 3x faster than boolean-mask indexing here.
        pos = np.flatnonzero((rows >= start) & (rows < start + len(shard_labels)))
        local = rows[pos] - start
        images[pos] = np.take(shard_images, local, axis=0)
        labels[pos] = shard_labels[local]
    return images, labels


def _join(
    first: tuple[np.ndarray, np.ndarray], then: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate([first[0], then[0]]), np.concatenate([first[1], then[1]])


class ShardStream:
    """Serve a split's shards as device batches, bounded in memory, reproducible per epoch."""

    def __init__(
        self,
        infos: list[ShardInfo],
        classes: list[str],
        device: torch.device,
        *,
        budget_bytes: int,
        eval_view: Callable[[np.ndarray], np.ndarray] | None = None,
        cache: ShardCache | None = None,
    ) -> None:
        """Serve ``infos``' shards; ``eval_view`` maps stored images to evaluated ones."""
        self.cache = cache
        self.gpu_wait_s = 0.0  # time batches waited for the GPU to free a pinned buffer
        if not infos:
            raise JobSpecError("a streamed split needs at least one shard")
        self.infos = infos
        self.eval_view = eval_view
        self.classes = classes
        self.device = device
        self.counts = [info.count for info in infos]
        self.count = sum(self.counts)
        self.shard_bytes = max(info.nbytes for info in infos)
        self.mix, self.prefetch = plan_slots(self.shard_bytes, budget_bytes)

    def __len__(self) -> int:
        return self.count

    def _add_gpu_wait(self, seconds: float) -> None:
        self.gpu_wait_s += seconds

    def _loader(self, uris: list[str]) -> _Prefetcher:
        return _Prefetcher(uris, self.classes, self.mix + self.prefetch, self.cache)

    @property
    def peak_bytes(self) -> int:
        """Return the most shard memory the stream holds at once."""
        return (self.mix + self.prefetch) * self.shard_bytes

    def train_batches(
        self,
        *,
        seed: int,
        epoch: int,
        batch_size: int,
        start_step: int = 0,
        rank: int = 0,
        world_size: int = 1,
        steps: int | None = None,
    ) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
        """Yield the epoch's batches from ``start_step`` on: this rank's share of each, on device;
        ``steps`` is what the boxes of a run agreed (default: the full batches the shards hold)."""
        steps = max(1, self.count // batch_size) if steps is None else steps
        per_rank = max(1, batch_size // world_size)
        batch_size = min(batch_size, self.count)
        if start_step >= steps:
            return
        windows = epoch_windows(self.counts, seed, epoch, self.mix)
        sizes = [sum(self.counts[i] for i in w) for w in windows]
        begin = start_step * batch_size
        first = 0
        while begin >= sizes[first]:
            begin -= sizes[first]
            first += 1
        share = np.arange(batch_size)[rank::world_size][:per_rank]
        copier = _DeviceCopier(self.device, self._add_gpu_wait)
        loader = self._loader([self.infos[i].uri for w in windows[first:] for i in w])
        step = start_step
        carry: tuple[np.ndarray, np.ndarray] | None = None  # a batch's start from the last window
        try:
            for number in range(first, len(windows)):
                shards = [loader.get() for _ in windows[number]]
                offsets = np.cumsum([0] + [len(lab) for _, lab in shards[:-1]]).tolist()
                order = window_order(sizes[number], seed, epoch, number)
                pos = begin if number == first else 0
                while step < steps:
                    held = 0 if carry is None else len(carry[1])
                    take = batch_size - held
                    if pos + take > len(order):
                        break
                    new_rows = share[share >= held] - held
                    x, y = _gather(shards, offsets, order[pos + new_rows])
                    if carry is not None:
                        keep = share[share < held]
                        x, y = _join((carry[0][keep], carry[1][keep]), (x, y))
                        carry = None
                    pos += take
                    step += 1
                    yield copier(x, y)
                if step < steps and pos < len(order):
                    # Copy the window's last images out, so the window can be released.
                    rest = _gather(shards, offsets, order[pos:])
                    carry = rest if carry is None else _join(carry, rest)
                del shards
                for _ in windows[number]:
                    loader.release()
                trim_heap()
                if step >= steps:
                    return
        finally:
            loader.close()

    def eval_batches(
        self, batch_size: int = EVAL_BATCH
    ) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
        """Yield every image once, shard by shard in file order, as device batches."""
        copier = _DeviceCopier(self.device)
        loader = self._loader([info.uri for info in self.infos])
        try:
            for _ in self.infos:
                images, labels = loader.get()
                for start in range(0, len(labels), batch_size):
                    chunk = images[start : start + batch_size]
                    if self.eval_view is not None:
                        chunk = np.ascontiguousarray(self.eval_view(chunk))
                    yield copier(chunk, labels[start : start + batch_size])
                del images, labels
                loader.release()
                trim_heap()
        finally:
            loader.close()


def sample_split(uris: list[str], classes: list[str], limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Return up to ``limit`` images (and label indices) evenly spaced over a split's shards, one
    shard at a time keeping only the chosen rows: the orchestrator never holds a split."""
    counts = [read_shard_info(uri, classes).count for uri in uris]
    total = sum(counts)
    picks = np.unique(np.linspace(0, total - 1, num=min(limit, total)).round().astype(np.int64))
    images: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    start = 0
    for uri, count in zip(uris, counts, strict=True):
        local = picks[(picks >= start) & (picks < start + count)] - start
        if len(local):
            shard_images, shard_labels = load_shard(uri, classes)
            images.append(shard_images[local])  # a copy: the shard's memory goes at once
            labels.append(shard_labels[local])
            del shard_images
        start += count
    if not images:
        raise ValueError(f"no images in the shards {uris[:3]}")
    return np.concatenate(images), np.concatenate(labels)
