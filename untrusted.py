"""Reading a checkpoint that may come from anyone (downloaded, or copied from
a shared disk): a file is read only where it is what it claims to be, and
then as data alone. checkpoint.py and huggingface.py read through it.
"""

import contextlib
import dataclasses
import enum
import errno
import functools
import glob
import hashlib
import importlib
import io
import os
import pickle
import pickletools
import re
import stat
import warnings
import zipfile

import numpy as np
import torch

from launch import UsageError, atomic_write

DIGESTS = "checksums.sha256"  # every file's sha256, in sha256sum's format (`sha256sum -c` reads it)
DIST_METADATA = ".metadata"  # torch.distributed.checkpoint's index, written last: a torch_dist checkpoint


# 1. Plain files: a name a checkpoint gives is a regular file of its own
# directory, never a link, FIFO or device, nor a path that leads elsewhere.

def plain_file_problem(directory: str, name: str) -> str | None:
    """Why `name` is not a plain file of `directory`, or None. The names a
    checkpoint gives (checksums.sha256's, DCP's index's, a Hugging Face
    index's) may not lead elsewhere: a bare file name (no directory part, no
    `..`, nothing sha256sum would escape) of a regular file there, not a
    link, directory, FIFO or device, which a tar or zip can carry and whose
    reading would go outside the checkpoint or never end."""
    if name in ("", ".", "..") or any(c in name for c in "/\\\n\r\0"):
        return f"{name!r} is not a file name in the checkpoint's directory"
    path = os.path.join(directory, name)
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return f"{name} is missing"
    if stat.S_ISLNK(mode):
        return f"{name} is a symbolic link (to {os.readlink(path)}), not a file"
    return None if stat.S_ISREG(mode) else f"{name} is {_not_a_file(mode)}, not a file"


def _not_a_file(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(mode)), "a device")


@contextlib.contextmanager
def regular_file(path: str, follow: bool = False):
    """(binary file, size) of `path`, opened only if it is a regular file
    (and, unless `follow`, not a link), checked before the open and again on
    the open file; a UsageError otherwise. A FIFO never blocks the open, and
    a reader takes no more than `size` bytes: /dev/zero has no end."""
    mode = (os.stat if follow else os.lstat)(path).st_mode
    if not stat.S_ISREG(mode):
        what = "a symbolic link" if stat.S_ISLNK(mode) else _not_a_file(mode)
        raise UsageError(f"{path} is {what}, not a file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
    except OSError as e:  # swapped for a link since the check
        if e.errno != errno.ELOOP:
            raise
        raise UsageError(f"{path} is a symbolic link, not a file") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # swapped since the check
            raise UsageError(f"{path} is {_not_a_file(info.st_mode)}, not a file")
        os.set_blocking(fd, True)  # O_NONBLOCK was for the open alone
        yield f, info.st_size


def named_files(directory: str, names, index: str, links: bool = False) -> list[str]:
    """directory/name of each name a checkpoint's own index (DCP's .metadata,
    a Hugging Face weight map) gives: only a plain file of the directory
    (plain_file_problem) and, where it has digests, one they list (verified
    before it is read); anything else would have a checkpoint read whatever
    file it chose. `links`: a link to a regular file is read too (a Hugging
    Face cache's snapshot is links into its blobs/, as transformers reads it)."""
    listed = listed_digests(directory) if os.path.exists(os.path.join(directory, DIGESTS)) else None
    paths = {}
    for name in names:
        if isinstance(name, str) and name in paths:  # DCP's index names each file many times
            continue
        problem = plain_file_problem(directory, name) if isinstance(name, str) else f"{name!r} is not a file name"
        if problem and links and os.path.islink(os.path.join(directory, name)) and \
                os.path.isfile(os.path.join(directory, name)):
            problem = None
        if problem is None and listed is not None and name not in listed:
            problem = f"{name} is not one of the files its {DIGESTS} lists"
        if problem:
            raise UsageError(f"refusing to read the checkpoint in {directory}: {index} names {name!r}, not one of "
                             f"its own files ({problem}). Load checkpoints only from a source you trust")
        paths[name] = os.path.join(directory, name)
    return list(paths.values())


# 2. Digests: every file's sha256, listed beside them at a save (DIGESTS) and
# checked before a load reads them.

def sha256_of(path: str) -> str:
    """The sha256 of a regular file's bytes (regular_file), read in blocks."""
    digest = hashlib.sha256()
    with regular_file(path) as (f, left):
        while left > 0 and (block := f.read(min(left, 1 << 24))):
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def listed_digests(directory: str) -> dict[str, str]:
    """name -> sha256 of every line of directory's DIGESTS, in sha256sum's
    format: `SHA256  NAME`, or `SHA256 *NAME` as `sha256sum -b` writes (its
    binary mode hashes the same bytes). A UsageError names a line of any
    other form; the names are checked where they are read (damage)."""
    path, listed = os.path.join(directory, DIGESTS), {}
    with regular_file(path) as (f, size):
        text = f.read(size).decode("utf-8", "replace")
    for number, line in enumerate(text.removesuffix("\n").split("\n") if text else [], 1):
        match = re.fullmatch(r"([0-9a-fA-F]{64}) [ *](.+)", line)
        if not match or match[2] in listed:
            raise UsageError(f"line {number} of {DIGESTS}, {line[:80]!r}, is not `SHA256  NAME` of a file "
                             f"listed once")
        listed[match[2]] = match[1].lower()
    return listed


def digest_files(directory: str, names: list[str]) -> dict[str, str]:
    return {name: sha256_of(os.path.join(directory, name)) for name in names}


def write_digests(directory: str, digests: dict[str, str]) -> None:
    text = "".join(f"{d}  {name}\n" for name, d in sorted(digests.items()))
    atomic_write(os.path.join(directory, DIGESTS), lambda f: f.write(text.encode()))


def digests_problem(directory: str, names: list[str]) -> str | None:
    """damage's verdict on the files `names` of a directory with DIGESTS
    (each of which damage found a plain file already)."""
    listed = listed_digests(directory)
    there = set(names)  # so only a listed name not among them is left to judge: missing, or no plain name
    problem = next(filter(None, (plain_file_problem(directory, name) for name in listed if name not in there)), None)
    if problem:  # before any file is read
        return problem
    unlisted = [name for name in names if name not in listed and name != DIGESTS]
    if unlisted:  # another run's, saved over this one (at another data-parallel size, say)
        return (f"{', '.join(unlisted)} {'is' if len(unlisted) == 1 else 'are'} not listed in {DIGESTS} "
                f"(another save's, written over this one?)")
    for name, digest in listed.items():
        if sha256_of(os.path.join(directory, name)) != digest:
            return f"{name} is damaged (its sha256 is not the one {DIGESTS} records)"
    return None


# 3. Data only: torch.load unpickles, and a pickle may name any function for the
# reader to call: a downloaded checkpoint could run a command on every rank that
# reads it. So every checkpoint file is read as weights_only: tensors, numbers,
# strings and containers, plus the few types below, which rebuild data and call
# nothing else. DeepSpeed's own reads (engine.load_checkpoint, zero_to_fp32) pass
# weights_only=False; torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD overrides that.

# A file of another pickle protocol than torch.save's is refused in one line, without torch's warning too.
warnings.filterwarnings("ignore", "Detected pickle protocol")


def _data_types(deepspeed: bool) -> list:
    """numpy's ndarray, for np.random's state in every checkpoint's "rng"; with
    `deepspeed`, DeepSpeed's enum, loss scalers and fragment addresses, in its
    optimizer files (a plain or torch_dist load imports no DeepSpeed)."""
    rebuild = np.zeros(0).__reduce__()[0]  # numpy's array reconstructor, under both its module names:
    types = [np.ndarray, np.dtype, type(np.dtype(np.uint32)),  # the state's key array is uint32
             (rebuild, "numpy._core.multiarray._reconstruct"),  # numpy 2
             (rebuild, "numpy.core.multiarray._reconstruct")]  # numpy 1's checkpoints
    if not deepspeed:
        return types
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
        types += [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]
    except ImportError:  # no DeepSpeed here: no file needs its types
        pass
    return types


@contextlib.contextmanager
def data_only_loads(where: str, kind: str = "plain"):
    """Every torch.load inside, DeepSpeed's included, reads data only
    (weights_only=True). A file that holds anything else is not read: one
    line names it and what it holds. `where`: the checkpoint's directory (or
    file), of `kind` ("plain", "torch_dist" or "deepspeed"; see _pickles_in)."""
    force, before = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ[force] = "1"
    try:
        with torch.serialization.safe_globals(_data_types(kind == "deepspeed")):
            try:
                yield
            except pickle.UnpicklingError as e:
                raise UsageError(_code_in_files(where, kind, e)) from None
    finally:
        if before is None:
            del os.environ[force]
        else:
            os.environ[force] = before


def _code_in_files(where: str, kind: str, error: pickle.UnpicklingError) -> str:
    """Which files under `where` hold more than data, found without unpickling
    them (a static scan); else what the unpickler refused."""
    shown = "; ".join(f"{f} holds {', '.join(found)}" for f, found in _pickles_in(where, kind, error) if found)
    if not shown:
        reason = [line for line in str(error).splitlines() if "global" in line.lower() or "got <" in line]
        shown = f"a file there holds {(reason or ['more than data'])[0].strip()}"
    return (f"refusing to read the checkpoint in {where}: {shown}, not data (tensors, numbers, "
            f"containers); a file like that can run code when it is read. Load checkpoints only "
            f"from a source you trust")


def _pickles_in(where: str, kind: str, error: pickle.UnpicklingError):
    """(a pickle's name, the globals in it that weights_only refuses) for each
    pickle a load reads under `where`: its .pt files, or a torch_dist
    checkpoint's non-tensors, each a torch.save zip within a .distcp file
    (unless the refusal was of its index, .metadata, itself)."""
    if kind != "torch_dist":
        for path in sorted(glob.glob(os.path.join(where, "*.pt"))) if os.path.isdir(where) else [where]:
            with open(path, "rb") as f:
                yield path, _unsafe_globals(f)
    elif DIST_METADATA not in str(error):
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata
        metadata = dist_reader(where).read_metadata()
        for index, info in metadata.storage_data.items():
            if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                with open(os.path.join(where, info.relative_path), "rb") as f:
                    f.seek(info.offset)
                    piece = io.BytesIO(f.read(info.length))
                yield f"{os.path.join(where, info.relative_path)} (its {index.fqn})", _unsafe_globals(piece)


def _unsafe_globals(f) -> list[str]:
    """The globals in a file torch.load reads (f: open, binary) that weights_only
    refuses, read statically: torch's own scan of a torch.save zip, else of
    the pickles of torch's legacy (pre-zip) format or a raw pickle, against
    the same allow-list."""
    zipped = zipfile.is_zipfile(f)
    f.seek(0)
    if zipped:
        return torch.serialization.get_unsafe_globals_in_checkpoint(f)
    from torch._weights_only_unpickler import _get_allowed_globals, _get_user_allowed_globals
    return sorted(_pickle_globals(f) - set(_get_allowed_globals()) - set(_get_user_allowed_globals()))


def _pickle_globals(f) -> set[str]:
    """Every module.name the pickles at the start of a file (f: open, binary)
    name (torch's legacy format is five pickles, then raw bytes; a raw pickle
    is one), by reading their opcodes: a protocol 4 global takes the two
    strings last pushed or fetched from the memo."""
    found, strings, memo, top = set(), [], {}, None
    for _ in range(5):
        try:
            for op, arg, _ in pickletools.genops(f):
                if op.name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                    memo[len(memo) if arg is None else arg] = top
                    continue
                if op.name in ("GET", "BINGET", "LONG_BINGET"):
                    arg = memo.get(arg)
                if op.name == "GLOBAL":
                    found.add(arg.replace(" ", "."))
                elif op.name == "STACK_GLOBAL":
                    found.add(".".join(strings[-2:]))
                top = arg if isinstance(arg, str) and op.name != "GLOBAL" else None
                if top is not None:
                    strings.append(top)
        except ValueError:  # past the pickles: the raw bytes of tensors, or the end
            break
    return found


# 4. torch.distributed.checkpoint's index (DIST_METADATA, itself a pickle),
# read with DCP's metadata classes alone.

def dist_reader(path: str):
    """DCP's reader, but its index (DIST_METADATA, a pickle) is read with
    only DCP's metadata classes and torch's dtypes allowed: a torch_dist
    checkpoint never runs code from its files either (see data_only_loads)."""
    import torch.distributed.checkpoint as dcp
    reader = dcp.FileSystemReader(path)

    def read_metadata(*args, **kwargs):
        with open(os.path.join(path, DIST_METADATA), "rb") as f:
            metadata = DistMetadataUnpickler(f).load()
        named_files(path, (info.relative_path for info in metadata.storage_data.values()),
                    os.path.join(path, DIST_METADATA))  # before DCP opens any of them
        metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = reader.load_id
        return metadata
    reader.read_metadata = read_metadata  # in place of DCP's unpickling of the index
    return reader


class DistMetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes (dataclasses and enums), torch's dtypes, and the
    few helpers its pickle names; any other global is refused before it is
    looked up: finding a global imports its module, which runs its code."""
    ALSO = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}
    DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")

    def find_class(self, module: str, name: str):
        if (module, name) in dcp_metadata_globals():
            return super().find_class(module, name)  # a module imported already
        raise pickle.UnpicklingError(f"the global {module}.{name} in {DIST_METADATA}")


@functools.cache
def dcp_metadata_globals() -> frozenset:
    """What DistMetadataUnpickler allows, as (module, name): read off this
    torch's DCP modules, so the list follows torch's versions."""
    allowed = set(DistMetadataUnpickler.ALSO)
    allowed |= {("torch", n) for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
    for module in DistMetadataUnpickler.DCP_MODULES:
        for n, v in vars(importlib.import_module(module)).items():
            if isinstance(v, type) and v.__module__ == module and (
                    dataclasses.is_dataclass(v) or issubclass(v, enum.Enum)):
                allowed.add((module, n))
    return frozenset(allowed)


def read_dist_metadata(path: str):
    with data_only_loads(path, "torch_dist"):
        return dist_reader(path).read_metadata()
