"""A state as one flat buffer plus a small index: the memory tier's slots and the CUDA staging.

    state     {"model": {"w": T0, "b": T1}, "step": 12, "moments": [T2]}
    split  →  skeleton {"model": {"w": Hole(0), "b": Hole(1)}, "step": 12, "moments": [Hole(2)]}
              tensors  [T0, T1, T2], names ["model/w", "model/b", "moments/0"]
    layout →  one Entry per tensor (name, dtype, shape, offset, bytes, device) at aligned offsets

The format does not depend on the device (only the copy does: ``staging``); anything but a plain
dense tensor stays in the skeleton, pickled beside the index.
"""

import collections
import copy
import pickle
from typing import TYPE_CHECKING, Any, List, NamedTuple, Sequence, Tuple, Type

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["Entry", "Hole", "Layout", "Split", "decode_index", "encode_index", "on_cuda", "rebuild", "split"]

ALIGN = 512  # bytes: where each tensor starts in the buffer (what CUDA's allocator aligns to)
_VERSION = 1


class Hole(NamedTuple):
    """Where the skeleton held tensor ``index``; ``spec``: a DTensor's, when the tensor is its
    local shard (in-process only: the memory tier stores local shards as plain tensors)."""

    # The field shadows tuple.index (to mypy, an incompatible override): no one calls that on a Hole.
    index: int  # type: ignore[assignment]
    spec: Any = None


class Entry(NamedTuple):
    name: str  # the tensor's path in the state, e.g. "state/model/fc.weight"
    dtype: str  # "float32"
    shape: Tuple[int, ...]
    offset: int  # bytes from the start of the buffer
    nbytes: int
    device: str  # where the tensor was: "cpu", "cuda:0"

    @property
    def torch_dtype(self) -> torch.dtype:
        found = getattr(torch, self.dtype, None)
        if not isinstance(found, torch.dtype):
            raise ValueError(f"{self.name}: unknown dtype {self.dtype!r}")
        return found

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")


class Layout(NamedTuple):
    entries: Tuple[Entry, ...]
    size: int  # bytes of the whole buffer

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> "Layout":
        entries, offset = [], 0
        for tensor, name in zip(tensors, names):
            nbytes = tensor.numel() * tensor.element_size()
            dtype = str(tensor.dtype).removeprefix("torch.")
            entries.append(Entry(name, dtype, tuple(tensor.shape), offset, nbytes, str(tensor.device)))
            offset += -(-nbytes // ALIGN) * ALIGN
        return cls(tuple(entries), offset)


class Split(NamedTuple):
    skeleton: Any
    tensors: List[torch.Tensor]
    names: List[str]

    @property
    def layout(self) -> Layout:
        return Layout.of(self.tensors, self.names)

    @property
    def on_cuda(self) -> bool:
        return any(t.is_cuda for t in self.tensors)


def split(state: Any, copy_objects: bool, dtensors: bool = False) -> Split:
    """The state's tensors, in order, and its skeleton (a ``Hole`` for each). ``copy_objects``:
    deep-copy the rest, which the loop may change; ``dtensors``: a DTensor's local shard too."""
    tensors: List[torch.Tensor] = []
    names: List[str] = []
    dtensor = _dtensor_type() if dtensors else None

    def walk(value: Any, path: str) -> Any:
        spec = None
        if dtensor is not None and isinstance(value, dtensor) and _flat_tensor(value.to_local()):
            value, spec = value.to_local(), value._spec
        if _flat_tensor(value):
            tensors.append(value.detach())
            names.append(path)
            return Hole(len(tensors) - 1, spec)
        if type(value) in (dict, collections.OrderedDict):  # a state_dict is an OrderedDict
            return type(value)((k, walk(v, f"{path}/{k}")) for k, v in value.items())
        if type(value) in (list, tuple):
            return type(value)(walk(v, f"{path}/{i}") for i, v in enumerate(value))
        return copy.deepcopy(value) if copy_objects else value

    skeleton = walk(state, "")
    return Split(skeleton, tensors, [n.lstrip("/") or "." for n in names])


def on_cuda(state: Any) -> bool:
    """Whether the state holds a CUDA tensor that ``split`` would put in the buffer."""
    if _flat_tensor(state):
        return state.is_cuda
    if type(state) in (dict, collections.OrderedDict):
        return any(on_cuda(v) for v in state.values())
    if type(state) in (list, tuple):
        return any(on_cuda(v) for v in state)
    return False


def rebuild(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The skeleton with each ``Hole`` filled by its tensor (containers rebuilt, the rest as is)."""
    if isinstance(skeleton, Hole):
        if skeleton.spec is not None:
            return _dtensor_type()(tensors[skeleton.index], skeleton.spec, requires_grad=False)
        return tensors[skeleton.index]
    if type(skeleton) in (dict, collections.OrderedDict):
        return type(skeleton)((k, rebuild(v, tensors)) for k, v in skeleton.items())
    if type(skeleton) in (list, tuple):
        return type(skeleton)(rebuild(v, tensors) for v in skeleton)
    return skeleton


def encode_index(layout: Layout, skeleton: Any) -> bytes:
    """The index of a slot: its entries and the pickled skeleton (the state's other objects).
    Pickling is the skeleton's snapshot: what the loop changes afterwards is not in it."""
    entries = [tuple(e) for e in layout.entries]
    return pickle.dumps(
        {"version": _VERSION, "size": layout.size, "entries": entries, "objects": skeleton}, 5
    )


def decode_index(data: bytes) -> Tuple[Layout, Any]:
    """(Layout, skeleton) of an index; ValueError if it is not one this version wrote."""
    try:
        found = pickle.loads(data)
        if found["version"] != _VERSION:
            raise ValueError(f"index version {found['version']}, this worker_lib reads {_VERSION}")
        entries = tuple(Entry(n, d, tuple(s), int(o), int(b), dev) for n, d, s, o, b, dev in found["entries"])
        return Layout(entries, int(found["size"])), found["objects"]
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError) as err:
        raise ValueError(f"the snapshot's index is damaged: {err}") from None


def _flat_tensor(value: Any) -> bool:
    """A tensor that goes into the buffer as its bytes: dense, on the CPU or a CUDA device, of
    a plain type (a Parameter too; a DTensor or another subclass stays in the skeleton)."""
    return (
        type(value) in (torch.Tensor, torch.nn.Parameter)
        and value.layout == torch.strided
        and not value.is_quantized
        and value.device.type in ("cpu", "cuda")
    )


def _dtensor_type() -> "Type[DTensor]":
    from torch.distributed.tensor import DTensor

    return DTensor
