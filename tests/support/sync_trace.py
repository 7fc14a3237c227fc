"""Host syncs of the CUDA code path, traced on fake CUDA tensors on a machine without a GPU.

On a GPU, a call waits for the device (a *host sync*) when it reads a value back
(``aten._local_scalar_dense``: ``item()``, ``bool()``, ``float()``, ``tolist()``) and when it
copies between the CPU and CUDA with ``non_blocking=False``: torch runs such a copy as
``cudaMemcpyAsync`` then ``cudaStreamSynchronize``, so ``torch.tensor(list, device="cuda")``,
``t.new_tensor(list)``, ``cpu_t.to("cuda")`` and indexing a CUDA tensor with a Python list or a
CPU index tensor all wait for every queued kernel.

Inside ``FakeTensorMode``, ``torch.randn(n, device="cuda")`` is a fake CUDA tensor on a CPU-only
build: every op runs its meta kernel, and no data exists. :class:`SyncRecorder`, a
``TorchDispatchMode`` entered above the fake mode, sees every aten op first and records, with the
Python stack:

- ``read``: ``_local_scalar_dense`` (or ``equal``) on a CUDA tensor (the element-by-element reads
  of one ``tolist()`` count once);
- ``blocking copy``: ``_to_copy`` / ``copy_`` between CPU and CUDA without ``non_blocking``, and a
  CPU index tensor handed to a CUDA ``index`` / ``index_put_`` (a Python list index shows as the
  ``_to_copy`` that makes it a CUDA tensor);
- ``data-dependent shape``: ``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``,
  ``repeat_interleave`` without ``output_size`` on CUDA (the size must be read back);
- ``device mismatch``: a CUDA op handed a CPU tensor of more than 0 dims (a 0-dim CPU tensor is
  read as a host scalar, without a sync, as torch's clip reads a CPU ``max_norm``);
- ``CPU collective``: a c10d collective handed a CPU tensor.

So that the code goes on as on a healthy step, every read is answered with the value the caller
chose (0: no NaN, no mismatch; 1: finite), ``equal`` with True, and a mask or ``nonzero`` as if
every element were true. Ops that take no fake tensor and leave their result on the CPU (a
DeviceMesh's rank map, a list made a tensor, an optimizer's step count) run for real, outside the
fake mode, so host values are real. DTensor ops are left to DTensor (the recorder returns
``NotImplemented``), so the ops they lower to on local shards, collectives included, pass through
the recorder too.

What the trace cannot see: syncs inside CUDA kernels (meta kernels run instead) and the
differences between releases in how Python indexing lowers (on 2.15 ``t[i] = 1.0`` is a ``fill_``
with no CPU scalar copy). ``tests/test_gpu_*.py`` check the same paths on a real GPU under
``torch.cuda.set_sync_debug_mode("error")`` when one is present.

A CPU-only wheel has no CUDA device guard, so Python indexing or ``.to("cuda")`` of a fake CUDA
tensor raises there: :func:`load_noop_cuda_guard` builds and loads torch's own no-op guard
(``noop_cuda_guard.cpp``) with ``torch.utils.cpp_extension``, once per torch release, into
``build/`` of the repository.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

from credit.parallel import collectives

REPO = Path(__file__).resolve().parents[2]
LIBRARY = Path(collectives.__file__).resolve().parent
_TORCH = Path(torch.__file__).resolve().parent
_THIS_FILE = Path(__file__).resolve()
GUARD_SOURCE = Path(__file__).with_name("noop_cuda_guard.cpp")
_GUARD_NAME = "credit_noop_cuda_guard"
# torch's frames between the code that issues an op and the recorder.
_MACHINERY = tuple(
    _TORCH / part
    for part in (
        "_dynamo",
        "_compile.py",
        "_ops.py",
        "_subclasses",
        "utils/_python_dispatch.py",
        "utils/_contextlib.py",
        "distributed/tensor/_api.py",
        "distributed/tensor/_dispatch.py",
        "distributed/c10d_logger.py",
    )
)

READ = "read"
BLOCKING_COPY = "blocking copy"
DATA_DEPENDENT = "data-dependent shape"
DEVICE_MISMATCH = "device mismatch"
CPU_COLLECTIVE = "CPU collective"
KINDS = (READ, BLOCKING_COPY, DATA_DEPENDENT, DEVICE_MISMATCH, CPU_COLLECTIVE)

aten = torch.ops.aten
_READS = {aten._local_scalar_dense.default, aten.equal.default}
_COPIES = {aten._to_copy.default, aten.copy_.default}
_INDEXING = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
    aten._unsafe_index.Tensor,
    aten._unsafe_index_put.default,
}
_DATA_DEPENDENT = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
    aten._unique.default,
    aten._unique2.default,
    aten.bincount.default,
}
# Answered as if every mask were all True (see _as_if_all_true); the others raise, recorded.
_MASKABLE = {aten.nonzero.default, aten.masked_select.default, *_INDEXING}
_REPEAT_INTERLEAVE = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
_MASK_DTYPES = (torch.bool, torch.uint8)


# ---------------------------------------------------------------------------------------------
# the no-op CUDA guard


def guard_build_directory() -> Path:
    """Where the guard is built: under the repository's ignored ``build/``, one directory per
    torch release and Python, kept between runs of the suite."""
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return REPO / "build" / "noop-cuda-guard" / f"torch-{torch.__version__}-{python}"


def load_noop_cuda_guard() -> tuple[float, str | None]:
    """Give fake CUDA tensors a device guard: build (once) and load torch's no-op one.

    Returns:
        The seconds it took, and None once a guard is there, or why none could be built (no C++
        compiler, no ninja, or the build failed).
    """
    started = time.perf_counter()
    if torch.version.cuda is not None or torch.version.hip is not None:
        return 0.0, None  # a CUDA build registers its own guard
    directory = guard_build_directory()
    built = directory / f"{_GUARD_NAME}.so"
    if built.exists() and built.stat().st_mtime >= GUARD_SOURCE.stat().st_mtime:
        torch.ops.load_library(str(built))
        return time.perf_counter() - started, None
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return 0.0, f"no C++ compiler ({compiler!r} is not on PATH) to build the no-op CUDA guard"
    if not cpp_extension.is_ninja_available():
        return 0.0, "torch.utils.cpp_extension needs ninja to build the no-op CUDA guard"
    directory.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(
            name=_GUARD_NAME,
            sources=[str(GUARD_SOURCE)],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except Exception as error:  # a broken toolchain: say what it said
        return time.perf_counter() - started, f"building the no-op CUDA guard failed: {error}"
    return time.perf_counter() - started, None


# ---------------------------------------------------------------------------------------------
# the recorder


@dataclass(frozen=True)
class Sync:
    """One host sync (or a fault that would be one on a GPU), where it was issued.

    Attributes:
        kind: one of :data:`KINDS`.
        op: the aten op and what made it a sync, e.g. ``aten._to_copy cpu -> cuda``.
        where: the innermost frame of the repository's code that issued it (the library's, or a
            test's), as ``path:line (function)``.
        library: the innermost frame inside ``src/credit/parallel``, or None.
        origin: the innermost frame outside this module (inside torch when torch's own code
            issued the op, e.g. an optimizer's step).
    """

    kind: str
    op: str
    where: str
    library: str | None
    origin: str

    def __str__(self) -> str:
        text = f"{self.kind}: {self.op} at {self.where}"
        if self.library is not None and self.library != self.where:
            text += f", called from {self.library}"
        if self.origin != self.where:
            text += f" [issued in {self.origin}]"
        return text


class SyncRecorder(TorchDispatchMode):
    """Records every host sync of the ops it sees (see the module docstring).

    Enter it inside ``FakeTensorMode`` (above it on the mode stack).

    Args:
        answer: the value every host read returns (``bool(answer)`` for a bool tensor): what the
            code reads on a healthy step, e.g. 0 for "no NaN, no mismatch", 1 for "finite".
    """

    def __init__(self, answer: float = 0.0) -> None:
        super().__init__()
        self.answer = answer
        self.syncs: list[Sync] = []
        self._last_read: tuple | None = None  # a tolist() reads element by element: one sync

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor lowers it to local ops, which come back here
        tensors = [x for x in _pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        on_host = _on_host_data(kwargs, tensors)
        if func in _READS and not on_host:
            return self._read(func, tensors)
        if "device" not in func.name():  # a tolist() reads element by element, with nothing between
            self._last_read = None
        self._inspect(func, args, kwargs, tensors)
        if on_host:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func in _MASKABLE and any(t.device.type == "cuda" for t in tensors):
            return _as_if_all_true(func, args, kwargs)
        return func(*args, **kwargs)

    # --- what each op is ---------------------------------------------------------------------

    def _read(self, func: Any, tensors: list[torch.Tensor]) -> Any:
        if any(t.device.type == "cuda" for t in tensors):
            stack = _stack_key()
            if stack != self._last_read:  # the next element of the same tolist() is no new sync
                self._note(READ, _op_name(func))
            self._last_read = stack
        if func is aten.equal.default:
            return True  # copies are equal on a healthy step
        dtype = tensors[0].dtype
        if dtype == torch.bool:
            return bool(self.answer)
        if dtype.is_floating_point or dtype.is_complex:
            return float(self.answer)
        return int(self.answer)

    def _inspect(self, func: Any, args: Any, kwargs: dict, tensors: list[torch.Tensor]) -> None:
        cuda = any(t.device.type == "cuda" for t in tensors)
        if func.namespace in ("c10d", "_c10d_functional"):
            cpu = sorted({tuple(t.shape) for t in tensors if t.device.type == "cpu"})
            if cpu:
                self._note(CPU_COLLECTIVE, f"{_op_name(func)} of CPU tensors of shapes {cpu}")
            return
        if func is aten._to_copy.default:
            source, target = args[0].device, kwargs.get("device")
            if target is not None and not kwargs.get("non_blocking", False):
                self._copy(func, source, torch.device(target))
            return
        if func is aten.copy_.default:
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            if not non_blocking:
                self._copy(func, args[1].device, args[0].device)
            return
        if not cuda:
            return
        if func in _INDEXING:
            self._indices(func, args)
        elif func in _DATA_DEPENDENT:
            self._note(DATA_DEPENDENT, _op_name(func))
        elif func in _REPEAT_INTERLEAVE and kwargs.get("output_size") is None:
            self._note(DATA_DEPENDENT, f"{_op_name(func)} without output_size")
        mismatched = sorted(
            {tuple(t.shape) for t in tensors if t.device.type == "cpu" and t.dim() > 0}
        )
        if mismatched and func not in _INDEXING:
            self._note(DEVICE_MISMATCH, f"{_op_name(func)} on CUDA given CPU tensors {mismatched}")

    def _copy(self, func: Any, source: torch.device, target: torch.device) -> None:
        if {source.type, target.type} == {"cpu", "cuda"}:
            self._note(BLOCKING_COPY, f"{_op_name(func)} {source.type} -> {target.type}")

    def _indices(self, func: Any, args: Any) -> None:
        indices = [index for index in args[1] if index is not None]
        if any(index.dtype in _MASK_DTYPES for index in indices):
            self._note(DATA_DEPENDENT, f"{_op_name(func)} with a boolean mask")
        if any(index.device.type == "cpu" for index in indices):
            self._note(BLOCKING_COPY, f"{_op_name(func)} of a CUDA tensor with a CPU index")
        values = args[2] if len(args) > 2 else None
        if isinstance(values, torch.Tensor) and values.device.type == "cpu" and values.dim() > 0:
            self._note(DEVICE_MISMATCH, f"{_op_name(func)} on CUDA given CPU values")

    def _note(self, kind: str, op: str) -> None:
        frames = _frames()
        where = next((f for f in frames if _in_repo(f)), None)
        library = next((f for f in frames if _in_library(f)), None)
        self.syncs.append(
            Sync(
                kind=kind,
                op=op,
                where=_describe(where) if where is not None else "(outside the repository)",
                library=_describe(library) if library is not None else None,
                origin=_describe(frames[0]) if frames else "(no Python frame)",
            )
        )


def _on_host_data(kwargs: dict, tensors: list[torch.Tensor]) -> bool:
    """Whether an op takes no fake tensor and makes its result on the CPU: a DeviceMesh's rank
    map, a list made a tensor, an optimizer's step count. It is then computed for real, outside
    the fake mode, so that the code reads real host values."""
    if any(_is_fake(t) for t in tensors):
        return False
    target = kwargs.get("device")
    return target is None or torch.device(target).type == "cpu"


def _as_if_all_true(func: Any, args: Any, kwargs: dict) -> Any:
    """``func``'s result had every mask been all True and every element non-zero: the shapes
    the fake mode cannot know (recorded as data-dependent before), so that the code goes on."""
    if func is aten.nonzero.default:
        source = args[0]
        return source.new_empty((source.numel(), source.dim()), dtype=torch.long)
    if func is aten.masked_select.default:
        source, mask = args[0], args[1]
        return source.new_empty(torch.broadcast_shapes(source.shape, mask.shape).numel())
    indices = []
    for index in args[1]:
        if index is not None and index.dtype in _MASK_DTYPES:
            positions = index.new_empty(index.numel(), dtype=torch.long)
            indices.extend([positions] * index.dim())
        else:
            indices.append(index)
    return func(args[0], indices, *args[2:], **kwargs)


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def _op_name(func: Any) -> str:
    return f"{func.namespace}.{func.__name__}"


def _frames() -> list[FrameType]:
    """The Python stack, innermost first, without this module's frames and torch's dispatch
    machinery (so that the innermost is the code that issued the op)."""
    frames = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        path = _path(frame)
        if path != _THIS_FILE and not any(path.is_relative_to(m) for m in _MACHINERY):
            frames.append(frame)
        frame = frame.f_back
    return frames


def _stack_key() -> tuple:
    return tuple((id(f.f_code), f.f_lasti) for f in _frames())


def _path(frame: FrameType) -> Path:
    return Path(frame.f_code.co_filename).resolve()


def _in_repo(frame: FrameType) -> bool:
    path = _path(frame)
    return path.is_relative_to(REPO) and not path.is_relative_to(_TORCH)


def _in_library(frame: FrameType) -> bool:
    return _path(frame).is_relative_to(LIBRARY)


def _describe(frame: FrameType) -> str:
    path = _path(frame)
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    return f"{shown}:{frame.f_lineno} ({frame.f_code.co_name})"


_c10d_meta: list[Any] = []  # the library that keeps the kernels below registered


def register_fake_collectives() -> bool:
    """Give c10d's collectives fake kernels where torch has none (2.10; torch registers its own
    in ``torch.distributed._meta_registrations`` from 2.11): return the tensors and a completed
    ``FakeWork``, as torch's do. Returns whether they were registered here."""
    if torch._C._dispatch_has_kernel_for_dispatch_key("c10d::allreduce_", "Meta"):
        return False
    from torch._C._distributed_c10d import FakeWork

    def collective(*args: Any) -> tuple[Any, Any]:
        return args[0], FakeWork().boxed()

    library = torch.library.Library("c10d", "IMPL")
    for op in ("allreduce_", "broadcast_", "allgather_", "_allgather_base_"):
        library.impl(op, collective, "Meta")
    _c10d_meta.append(library)
    return True


@contextmanager
def fake_cuda() -> Iterator[None]:
    """Tensors created inside are fake; ``device="cuda"`` gives fake CUDA tensors.

    Real tensors may be mixed in (a DeviceMesh's rank map, built outside).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


@contextmanager
def recording(answer: float = 0.0) -> Iterator[list[Sync]]:
    """Record the host syncs of the code run inside (within :func:`fake_cuda`)."""
    recorder = SyncRecorder(answer)
    with recorder:
        yield recorder.syncs
