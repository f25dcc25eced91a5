"""worker_lib.checkpoint.dcp_reader: tensors viewed in place inside the files torch.distributed.checkpoint
wrote, and everything else left to torch.load."""

import io
import pickle
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from worker_lib.checkpoint.dcp_reader import MappedReader, tensor_in

_PLAIN = {
    "contiguous": lambda: torch.randn(3, 4),
    "transposed": lambda: torch.randn(3, 4).t(),
    "a slice with a storage offset": lambda: torch.arange(10)[2:7],
    "a scalar": lambda: torch.tensor(3.5),
    "empty": lambda: torch.empty(0, 5),
    "bfloat16": lambda: torch.randn(5).bfloat16(),
    "bool": lambda: torch.tensor([True, False, True]),
    "complex": lambda: torch.randn(2, 2, dtype=torch.complex64),
    "requires grad": lambda: torch.randn(4, requires_grad=True),
    "float8, pickled over untyped bytes": lambda: torch.randn(6).to(torch.float8_e4m3fn),
    "uint16": lambda: torch.arange(9).to(torch.uint16),
}


def _saved_at(value, before: bytes = b"x" * 13, after: bytes = b"y" * 7) -> bytearray:
    """``value`` torch.saved between other bytes, as items lie in a DCP file."""
    buffer = io.BytesIO()
    buffer.write(before)
    torch.save(value, buffer)
    buffer.write(after)
    return bytearray(buffer.getvalue())


def _bits(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.reshape(-1).contiguous().view(torch.uint8).tolist())


@pytest.mark.parametrize("make", _PLAIN.values(), ids=_PLAIN.keys())
def test_a_plain_tensor_is_viewed_in_place_with_its_dtype_shape_and_strides(make):
    tensor = make().detach()
    region = _saved_at(tensor)
    found = tensor_in(region, 13, len(region) - 20)
    assert found is not None and found.dtype == tensor.dtype
    assert found.shape == tensor.shape and found.stride() == tensor.stride()
    assert _bits(found) == _bits(tensor)  # float8 has no ==
    region[:] = bytes(len(region))  # a view of the region, not a copy: it now reads zeros
    assert _bits(found) == bytes(len(_bits(found)))


def test_anything_but_a_plain_tensor_is_left_to_torch_load():
    cases = {
        "a parameter": torch.nn.Parameter(torch.randn(3)),
        "a conjugate view": torch.randn(3, dtype=torch.complex64).conj(),  # its pickle's metadata says so
        "a negative view": torch._neg_view(torch.arange(3.0)),
        "a dict of tensors": {"w": torch.randn(3)},
        "a number": 7,
    }
    for name, value in cases.items():
        region = _saved_at(value)
        assert tensor_in(region, 13, len(region) - 20) is None, name


def test_damaged_or_misplaced_bytes_are_declined_not_misread():
    region = _saved_at(torch.randn(64))
    assert tensor_in(region, 12, len(region) - 20) is None  # one byte early: not a zip there
    assert tensor_in(region, 13, len(region) - 40) is None  # cut short
    assert tensor_in(region, 13, len(region)) is None  # past the end of the file
    assert tensor_in(bytes(100), 0, 100) is None


def test_no_cut_and_no_flipped_byte_makes_it_raise():
    # The bytes are checked against the commit marker before DCP reads them; still, whatever
    # tensor_in cannot parse must come back as None (torch.load then says what is wrong).
    saved = _saved_at(torch.arange(6.0), before=b"", after=b"")
    for cut in range(len(saved)):
        assert tensor_in(saved, 0, cut) is None or cut == len(saved)
    for position in range(len(saved)):
        flipped = bytearray(saved)
        flipped[position] ^= 0xFF
        found = tensor_in(flipped, 0, len(flipped))
        assert found is None or found.shape == (6,)


def test_a_pickle_naming_any_other_callable_runs_nothing(tmp_path):
    ran = tmp_path / "ran"

    class Opens:
        def __reduce__(self):
            return (open, (str(ran), "w"))

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps(Opens(), protocol=2))
        archive.writestr("archive/byteorder", "little")
    data = buffer.getvalue()
    assert tensor_in(data, 0, len(data)) is None
    assert not ran.exists()


def test_the_mapped_reader_loads_what_dcp_saved_tensors_in_place_the_rest_through_torch_load(tmp_path):
    conjugate = torch.randn(4, dtype=torch.complex64)
    state = {
        "weight": torch.randn(64, 32),
        "transposed": torch.randn(8, 16).t(),
        "half": torch.randn(100).bfloat16(),
        "conjugate": conjugate.conj(),  # declined by tensor_in: torch.load reads it
        "step": 7,  # bytes, not a tensor
        "nested": {"bias": torch.arange(6.0)},
    }
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path)), no_dist=True)
    assert _declined(tmp_path) == ["conjugate"]
    into = {
        "weight": torch.zeros(64, 32),
        "transposed": torch.zeros(16, 8),
        "half": torch.zeros(100, dtype=torch.bfloat16),
        "conjugate": torch.zeros(4, dtype=torch.complex64),
        "step": 0,
        "nested": {"bias": torch.zeros(6)},
    }
    dcp.load(into, storage_reader=MappedReader(str(tmp_path)), no_dist=True)
    for key in ("weight", "transposed", "half"):
        assert torch.equal(into[key], state[key]), key
    assert torch.equal(into["conjugate"], conjugate.conj().resolve_conj())
    assert into["step"] == 7 and torch.equal(into["nested"]["bias"], torch.arange(6.0))


def _declined(folder) -> list:
    """The tensors of a DCP folder that tensor_in leaves to torch.load."""
    metadata = MappedReader(str(folder)).read_metadata()
    declined = []
    for index, info in metadata.storage_data.items():
        data = (folder / info.relative_path).read_bytes()
        if isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata):
            if tensor_in(data, info.offset, info.length) is None:
                declined.append(index.fqn)
    return declined
