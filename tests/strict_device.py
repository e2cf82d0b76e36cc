"""Strict-device harness: check on the CPU what a GPU would check (the README's "Offloaded runtime":
no CPU shortcut around transfer code, no host read in a decode step).

On a CPU-only machine the "host" tier (the offloaded KV in `HostKVStore`) and the "device" tier are
both CPU tensors, so a test cannot see an op that mixes them (on CUDA: "indices should be either on
cpu or on the same device as the indexed tensor", or a silent CPU fallback), nor a read-back that a
GPU pays for with a sync.  This module makes both visible.

Host vs device is decided by *identity*: a tensor whose storage was allocated by
`forecastkv.inference.host_store.allocate_host` (wrapped here while a context is active) is host;
every other tensor is device.  Views share the storage, so they stay host.

* `strict_host()`: host tensors are `StrictHostTensor`s, whose ops raise `HostTensorTouched` unless
  they run inside `worker.host_transfer()` (the package's transfer functions enter it).  Metadata
  (`.shape`, `.numel()`, `.data_ptr()`, ...) never raises; `repr` shows metadata only.  Inside a
  transfer function a view of a host tensor stays strict, and `.to(...)` of a host tensor is the H2D
  copy: its result is a fresh device tensor, as on CUDA (on the CPU `.to("cpu")` would alias).
* `count_host_reads()`: counts host reads of device tensors (item/int/bool/float, nonzero,
  masked_select, boolean-mask indexing, data-dependent output sizes, `.cpu()`, `.to("cpu")`,
  `.tolist()`, `.numpy()`), per op and per call site, and, apart, D2H writes (a copy of a device
  tensor into a host tensor: the write-back).

Limits: see `count_host_reads`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
import traceback
import weakref

import torch
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from forecastkv.inference import host_store
from forecastkv.inference.worker import host_transfer, in_host_transfer

__all__ = [
    "HostTensorTouched",
    "ReadCounter",
    "StrictHostTensor",
    "count_host_reads",
    "host_transfer",
    "is_host",
    "strict_host",
]

aten = torch.ops.aten

# -- host identity --------------------------------------------------------------------------------

_original_allocate = host_store.allocate_host
_active = {"strict": 0, "tracking": 0}
# storage address -> weak reference to the tensor allocated there: an entry counts while that tensor
# lives (the store holds it), so a freed address reused by a device tensor is not taken for host
_host_storages: dict[int, weakref.ref] = {}


def _storage_address(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, fake, ...)
        return 0


def is_host(value) -> bool:
    """Whether `value` is a tensor on a host-store allocation (or a view of one)."""
    if isinstance(value, StrictHostTensor):
        return True
    if not isinstance(value, torch.Tensor) or not _host_storages:
        return False
    owner = _host_storages.get(_storage_address(value))
    return owner is not None and owner() is not None


def is_device(value) -> bool:
    """A tensor that is not host.  (On a CPU-only machine: every tensor not from the host store.)"""
    return isinstance(value, torch.Tensor) and not is_host(value)


def _allocate_host(shape, dtype, pin):
    """`allocate_host`, registered (and strict under `strict_host()`)."""
    tensor = _original_allocate(shape, dtype, pin)
    if _active["strict"]:
        tensor = tensor.as_subclass(StrictHostTensor)
    if tensor.numel():
        for address in [a for a, owner in _host_storages.items() if owner() is None]:
            del _host_storages[address]
        _host_storages[_storage_address(tensor)] = weakref.ref(tensor)
    return tensor


@contextlib.contextmanager
def _wrapping_allocations(kind: str):
    """Wrap `host_store.allocate_host` while any harness context is active (nesting allowed)."""
    if not any(_active.values()):
        host_store.allocate_host = _allocate_host
    _active[kind] += 1
    try:
        yield
    finally:
        _active[kind] -= 1
        if not any(_active.values()):
            host_store.allocate_host = _original_allocate


# -- strict host tensors --------------------------------------------------------------------------


class HostTensorTouched(RuntimeError):
    """An op outside a transfer function touched a host-store tensor."""


# reading these touches no element memory
_METADATA = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "layout",
        "ndim",
        "is_cuda",
        "is_cpu",
        "is_meta",
        "is_sparse",
        "is_quantized",
        "requires_grad",
        "grad",
        "grad_fn",
        "is_leaf",
        "names",
        "_base",
        "_is_view",
        "data_ptr",
        "untyped_storage",
        "size",
        "dim",
        "numel",
        "nelement",
        "element_size",
        "stride",
        "storage_offset",
        "is_contiguous",
        "is_pinned",
        "is_floating_point",
        "is_complex",
        "get_device",
        "__len__",
        "__hash__",
        "itemsize",
        "nbytes",
    }
)
_MOVES = frozenset({"to", "cuda"})  # inside a transfer function: the H2D copy (a fresh device tensor)


def _name(func) -> str:
    """'shape' for Tensor.shape.__get__, 'add' for Tensor.add, '__getitem__' ..."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class StrictHostTensor(torch.Tensor):
    """A host-store tensor (made with `as_subclass`) that only transfer functions may touch.

    Outside `host_transfer()` every torch function with one among its arguments raises
    `HostTensorTouched`, except metadata.  Inside, results sharing its storage (views, in-place
    results) stay strict; `.to(...)` results and other new tensors are plain (device) tensors.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        with torch._C.DisableTorchFunctionSubclass():
            if name in _METADATA:
                return func(*args, **kwargs)
            if not in_host_transfer():
                shapes = [tuple(a.shape) for a in _tensors((args, kwargs)) if isinstance(a, StrictHostTensor)]
                raise HostTensorTouched(
                    f"host-store tensor touched outside a transfer function: {resolve_name(func) or func} "
                    f"at {_call_site()[0]} (host operands of shape {shapes}); "
                    "only code inside worker.host_transfer() "
                    f"(the H2D gather/staging and the D2H write-back) may read or write host tensors"
                )
            out = func(*args, **kwargs)
            hosts = {_storage_address(a) for a in _tensors((args, kwargs)) if isinstance(a, StrictHostTensor)}

            def mark(value):
                if not isinstance(value, torch.Tensor) or _storage_address(value) not in hosts:
                    return value
                if name in _MOVES:  # the H2D copy: a device tensor, never an alias of host memory
                    return value.clone()
                return value if isinstance(value, StrictHostTensor) else value.as_subclass(StrictHostTensor)

            return tree_map(mark, out)

    def __repr__(self, *args, **kwargs) -> str:  # printing must not read host memory
        with torch._C.DisableTorchFunctionSubclass():
            return f"StrictHostTensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    def __format__(self, spec: str) -> str:
        return format(repr(self), spec)


def _tensors(tree) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda x: found.append(x) if isinstance(x, torch.Tensor) else None, tree)
    return found


@contextlib.contextmanager
def strict_host():
    """While active, every host-store buffer allocated is a `StrictHostTensor`.

    Use it around building *and* running a cache (allocation happens at the first `append`).
    Host tensors made before entering are not strict."""
    with _wrapping_allocations("strict"):
        yield


# -- the host-read counter ------------------------------------------------------------------------

_HARNESS = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


@dataclasses.dataclass
class Event:
    """One host read (or D2H write): the op, where the package called it, and the stack if kept."""

    op: str
    site: str
    stack: list[str] | None = None


def _call_site() -> tuple[str, list]:
    """The innermost frame outside torch and this harness, as 'file:line (function)', and the frame."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _HARNESS and not path.startswith(_TORCH_DIR):
            relative = os.path.relpath(path)
            short = path if relative.startswith("..") else relative
            return f"{short}:{frame.f_lineno} ({frame.f_code.co_name})", frame
        frame = frame.f_back
    return "?", None


class ReadCounter:
    """Host reads and D2H writes seen by `count_host_reads()`.

    reads: total host reads of device tensors; by_op / by_site: collections.Counter of them per op
    name (e.g. 'aten._local_scalar_dense', 'Tensor.cpu') and per 'op @ file:line (function)';
    d2h_writes, d2h_by_op, d2h_by_site: the same for copies of device tensors into host tensors;
    events: every read (`Event`, with `.stack` when counting with `stacks=True`).
    """

    def __init__(self, stacks: bool = False) -> None:
        self.stacks = stacks
        self.events: list[Event] = []
        self.by_op: collections.Counter = collections.Counter()
        self.by_site: collections.Counter = collections.Counter()
        self.d2h_by_op: collections.Counter = collections.Counter()
        self.d2h_by_site: collections.Counter = collections.Counter()

    @property
    def reads(self) -> int:
        return sum(self.by_op.values())

    @property
    def d2h_writes(self) -> int:
        return sum(self.d2h_by_op.values())

    def _record(self, op: str, write: bool = False) -> None:
        site, frame = _call_site()
        (self.d2h_by_op if write else self.by_op)[op] += 1
        (self.d2h_by_site if write else self.by_site)[f"{op} @ {site}"] += 1
        if not write:
            stack = traceback.format_stack(frame) if self.stacks and frame is not None else None
            self.events.append(Event(op, site, stack))

    def report(self) -> str:
        """A readable summary: totals, per op, per site."""
        lines = [f"host reads: {self.reads}, D2H writes: {self.d2h_writes}"]
        lines += [f"  read  {n:4d}  {key}" for key, n in self.by_site.most_common()]
        lines += [f"  write {n:4d}  {key}" for key, n in self.d2h_by_site.most_common()]
        return "\n".join(lines)


# ops whose result (or output size) depends on device values: a sync on CUDA
_READ_OPS = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.masked_select,
    aten.equal,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.bincount,
}
_MASKED_WRITES = {aten.index_put_, aten._index_put_impl_}
_WRITE_OPS = {aten.copy_, *_MASKED_WRITES}


def _bool_index(indices) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) and is_device(i) for i in indices or ()
    )


class _DispatchCounter(TorchDispatchMode):
    """The aten-level half: scalar reads, data-dependent shapes, real D2H copies (CUDA)."""

    def __init__(self, counter: ReadCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        first = args[0] if args else None
        if packet in _READ_OPS and is_device(first):
            self.counter._record(f"aten.{packet.__name__}")
        elif packet is aten.repeat_interleave and is_device(first) and func is aten.repeat_interleave.Tensor:
            self.counter._record("aten.repeat_interleave.Tensor")
        elif packet is aten.index and is_device(first) and _bool_index(args[1]):
            self.counter._record("aten.index(bool mask)")
        elif packet in _MASKED_WRITES and is_device(first) and _bool_index(args[1]):
            self.counter._record(f"aten.{packet.__name__}(bool mask)")
        elif packet in _WRITE_OPS and is_host(first):
            source = args[1] if packet is aten.copy_ else args[2]
            if is_device(source):
                self.counter._record(f"aten.{packet.__name__}", write=True)
        elif packet is aten.copy_ and first.device.type == "cpu" and args[1].device.type != "cpu":
            self.counter._record("aten.copy_(d2h)")  # CUDA: a copy of a device tensor into host memory
        elif (
            packet is aten._to_copy
            and first.device.type != "cpu"
            and torch.device(kwargs.get("device") or first.device).type == "cpu"
        ):
            self.counter._record("aten._to_copy(d2h)")
        return func(*args, **kwargs)


def _to_host_target(args, kwargs) -> bool:
    """Whether Tensor.to(*args, **kwargs) names the host: the string 'cpu' (a torch.device object
    is taken for the device tier, which on a CPU-only machine is 'cpu' too)."""
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and torch.device(target).type == "cpu"


class _FunctionCounter(TorchFunctionMode):
    """The Python-level half: copies to the host that a CPU run never dispatches (`.cpu()` and
    `.to("cpu")` of a CPU tensor are no-ops, `.tolist()`/`.numpy()` read memory directly)."""

    def __init__(self, counter: ReadCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if (
            name in ("cpu", "to", "tolist", "numpy", "__array__")
            and args
            and is_device(args[0])
            and args[0].device.type == "cpu"
        ):
            if name != "to" or _to_host_target(args[1:], kwargs):
                self.counter._record(f"Tensor.{name}" + ('("cpu")' if name == "to" else "()"))
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_reads(stacks: bool = False):
    """`with count_host_reads() as counter: ...` then `counter.reads`, `counter.by_op`,
    `counter.by_site`, `counter.d2h_writes`, `counter.report()` (see `ReadCounter`).

    stacks=True keeps the Python stack of every read (`counter.events[i].stack`).

    What it cannot see: memory read by a kernel through a raw pointer (Triton, the interpreter, C++
    extensions) and reads inside one aten kernel (only the ops dispatched from Python count: a
    nested aten call inside a kernel is not re-dispatched to the mode).  On a CPU-only machine
    `.to(torch.device("cpu"))` cannot be told from a move to the device tier and is not counted;
    only the string form `.to("cpu")` is.  Host tensors are known from their allocation: allocate
    them (build the cache and prefill) inside a harness context; per-step counters can nest in it.
    """
    counter = ReadCounter(stacks)
    with _wrapping_allocations("tracking"), _FunctionCounter(counter), _DispatchCounter(counter):
        yield counter
