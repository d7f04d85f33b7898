"""Single native files: torch.save files from a cached per-structure template, the batched copy, and
directory transactions holding their files back until the commit."""
from __future__ import annotations

import collections
import copy
import io
import os
import time
import zipfile

import pytest
import torch

from asyncckpt import core
from asyncckpt.core.snapshot.file_images import stage_image
from asyncckpt.core.snapshot.tensor_copy import PARALLEL_SMALL_BYTES, CopyThreads, copy_tensors
from asyncckpt.core.snapshot import torch_file_images as torch_file
from asyncckpt.core.snapshot.torch_file_images import TorchFileTemplates, pickle_records


def _checkpoint_like():
    """What a framework saves: weights (a view and a tied pair among them), optimizer state with
    scalar tensors, odd dtypes, and plain values that change from save to save."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, 32))
    embedding = torch.randn(100, 16)
    return {
        "state_dict": {"w": weight, "w_rows": weight.data[8:24], "embed": embedding, "lm_head": embedding,
                       "half": torch.randn(33).to(torch.bfloat16), "mask": torch.rand(17) > 0.5,
                       "empty": torch.empty(0, 4), "ids": torch.arange(10, dtype=torch.int64)},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(64, 32)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}]},
        "global_step": 1,
        "loops": {"name": "fit", "history": [1, 2, 3]},
    }


def _assert_same(ours, reference, path="obj"):
    """Equal values, dtypes, shapes, requires_grad; tensors sharing a storage in ``reference`` share one in ours."""
    assert type(ours) is type(reference), path
    if isinstance(reference, torch.Tensor):
        assert ours.dtype == reference.dtype and ours.shape == reference.shape, path
        assert ours.requires_grad == reference.requires_grad, path
        assert torch.equal(ours, reference), path
    elif isinstance(reference, dict):
        assert list(ours) == list(reference), path
        for key in reference:
            _assert_same(ours[key], reference[key], f"{path}[{key!r}]")
    elif isinstance(reference, (list, tuple)):
        assert len(ours) == len(reference), path
        for i, (a, b) in enumerate(zip(ours, reference)):
            _assert_same(a, b, f"{path}[{i}]")
    else:
        assert ours == reference, path


def _storage_groups(state):
    sd = state["state_dict"]
    return (sd["w"].untyped_storage().data_ptr() == sd["w_rows"].untyped_storage().data_ptr(),
            sd["embed"].untyped_storage().data_ptr() == sd["lm_head"].untyped_storage().data_ptr())


@pytest.mark.parametrize("weights_only", [True, False])
def test_template_file_loads_as_torch_save_across_changing_values(tmp_path, weights_only):
    """The non-tensor part changes size from save to save (growing, outgrowing the template's room,
    shrinking); every file loads exactly as torch.save's own would, through one template per size class."""
    state = _checkpoint_like()
    path = tmp_path / "last.ckpt"
    with core.Checkpointer() as checkpointer:
        for step, history in ((1, [1]), (10 ** 6, [1, 2]), (10 ** 40, list(range(3000))), (2, [])):
            state["global_step"] = step
            state["loops"]["history"] = history
            checkpointer.save_file(state, path)
            reference = io.BytesIO()
            torch.save(state, reference)
            reference.seek(0)
            expected = torch.load(reference, weights_only=weights_only)
            loaded = torch.load(path, weights_only=weights_only)
            _assert_same(loaded, expected)
            assert _storage_groups(loaded) == (True, True)
            mapped = torch.load(path, weights_only=weights_only, mmap=True)
            _assert_same(mapped, expected)
            with zipfile.ZipFile(path) as archive:  # a valid zip; the CRC-32s of all but the storage records are right
                assert archive.read("archive/data.pkl") == zipfile.ZipFile(reference).read("archive/data.pkl")
                assert [archive.read(n) for n in archive.namelist() if "/data/" not in n]
        assert len(checkpointer._parts.files.torch_files) == 1  # outgrown once, then reused


def test_structures_alternating_in_one_staging_buffer(tmp_path):
    """The framing is written only when the buffer's last file had another structure: alternate two."""
    first = {"a": torch.arange(1000.0), "b": torch.ones(10, dtype=torch.int64), "n": 1}
    second = {"b": torch.ones(10, dtype=torch.int64), "a": torch.arange(1000.0), "c": torch.zeros(3), "n": 2}
    with core.Checkpointer(max_in_flight=1) as checkpointer:
        for round_ in range(3):
            for name, state in (("first", first), ("second", second), ("second", second)):
                state["n"] = round_
                checkpointer.save_file(state, tmp_path / f"{name}.pt")
                _assert_same(torch.load(tmp_path / f"{name}.pt", weights_only=True), state)
        assert len([s for s in checkpointer._parts.buffers.slots() if s.key == "file"]) == 1


def test_tensors_mutated_after_the_call_do_not_reach_the_file(tmp_path):
    state = _checkpoint_like()
    with core.Checkpointer() as checkpointer:
        for step in range(3):  # the same structure: the cached template's path
            state["global_step"] = step
            expected = copy.deepcopy(state["state_dict"])
            handle = checkpointer.async_save_file(state, tmp_path / f"step{step}.ckpt")
            with torch.no_grad():
                for tensor in (state["state_dict"]["w"], state["state_dict"]["embed"], state["state_dict"]["mask"]):
                    tensor.fill_(True if tensor.dtype == torch.bool else 7)
            state["loops"]["history"].append(step)
            handle.result()
            loaded = torch.load(tmp_path / f"step{step}.ckpt", weights_only=True)
            _assert_same(loaded["state_dict"], expected)
            assert loaded["global_step"] == step and loaded["loops"]["history"] == [1, 2, 3] + list(range(step))


def _tensors_of_every_kind():
    base = torch.randn(6, 4)
    with_attribute = torch.ones(3)
    with_attribute.note = "kept"
    hooked = torch.ones(2, requires_grad=True)
    hooked.register_hook(torch.utils.hooks.unserializable_hook(lambda grad: grad))
    return {"f32": base, "t": base.t(), "rows": base[1:4], "bf16": base.to(torch.bfloat16), "scalar": torch.tensor(3),
            "empty": torch.empty(0, 5), "bool": base > 0, "grad": torch.ones(4, requires_grad=True),
            "param": torch.nn.Parameter(torch.ones(2, 2)), "u16": torch.arange(5).to(torch.uint16),
            "f8": base.to(torch.float8_e4m3fn), "conj": torch.randn(3, dtype=torch.complex64).conj(),
            "neg": torch.randn(3, dtype=torch.complex64).conj().imag, "attr": with_attribute, "hooked": hooked,
            "meta": torch.empty(3, device="meta"), "sparse": base.to_sparse(), "same": base, "plain": [1, "x", 2.5]}


def test_direct_tensor_reduction_pickles_as_torch_does():
    """Plain tensors are reduced without torch's generic path; every kind of tensor pickles to torch's bytes."""
    with pytest.warns(UserWarning, match="meta device"):  # torch's own warning for meta tensors under skip_data
        direct, _ = pickle_records(_tensors_of_every_kind(), plain_tensors_directly=True)
    with pytest.warns(UserWarning, match="meta device"):
        reference, _ = pickle_records(_tensors_of_every_kind())
    assert direct == reference


def test_a_structure_the_direct_reduction_gets_wrong_is_pickled_by_torch(tmp_path, monkeypatch):
    """Each new structure is pickled both ways once; if the bytes differ, torch's reduction is used for it."""
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 1}
    wrong = lambda tensor: (torch._utils._rebuild_tensor_v2, (  # noqa: E731 - loses the stride
        torch.storage.TypedStorage(wrap_storage=tensor.untyped_storage(), dtype=tensor.dtype, _internal=True),
        0, tuple(tensor.size()), (1, 1), False, collections.OrderedDict()))
    monkeypatch.setattr(torch_file, "_plain_tensor_reduce", wrong)
    templates = TorchFileTemplates()
    for step in (1, 2):
        state["step"] = step
        image = templates.image(state)
        target = torch.zeros(image.size, dtype=torch.uint8)
        stage_image(image, target, CopyThreads())
        _assert_same(torch.load(io.BytesIO(target.numpy().tobytes()), weights_only=True), state)
    assert list(templates._direct_pickle_ok.values()) == [False]


def test_files_beyond_4_gib_use_zip64_offsets(tmp_path):
    """Storage records past 4 GiB (zip64): rendered sparsely, so the big tensors are never touched."""
    big = torch.empty(3 << 30, dtype=torch.uint8)  # untouched memory costs nothing
    bigger = torch.empty(2 << 30, dtype=torch.uint8)
    small = torch.arange(10.0)
    image = TorchFileTemplates().image({"a": big, "b": bigger, "c": small, "step": 3})
    assert image.size > 5 << 30 and image.copies[2][0] > 1 << 32
    path = tmp_path / "big.pt"
    with open(path, "wb") as f:
        f.truncate(image.size)
        for offset, piece in image.all_pieces():
            f.seek(offset)
            f.write(piece)
        f.seek(image.copies[2][0])
        f.write(small.numpy().tobytes())
    loaded = torch.load(path, mmap=True, weights_only=True)
    assert torch.equal(loaded["c"], small) and loaded["step"] == 3 and loaded["b"].shape == bigger.shape


def test_stage_image_writes_strided_sources_in_their_layout():
    image = TorchFileTemplates().image({"t": torch.arange(12.0).reshape(3, 4).t()})  # a view: whole storage
    target = torch.zeros(image.size, dtype=torch.uint8)
    stage_image(image, target, CopyThreads())
    assert torch.equal(torch.load(io.BytesIO(target.numpy().tobytes()))["t"], torch.arange(12.0).reshape(3, 4).t())


def test_copy_tensors_large_small_and_split_over_two_threads():
    sources = [torch.randn(1 << 19)] + [torch.randn(4096) for _ in range(PARALLEL_SMALL_BYTES // (4096 * 4) + 10)]
    sources += [torch.randn(5, 7).t()]  # strided
    targets = [torch.empty_like(s) for s in sources]
    copy_tensors(targets, sources, CopyThreads())
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))


def test_directory_files_reach_the_writer_at_commit(tmp_path):
    """A transaction's files are written only from its commit on (or when somebody waits for one)."""
    with core.Checkpointer() as checkpointer:
        checkpointer.start()
        tx = checkpointer.begin_directory(tmp_path / "checkpoint-1", step=1)
        model = tx.save_file({"w": torch.ones(1 << 20)}, "model.safetensors", format="safetensors")
        state = tx.write_bytes("trainer_state.json", b"{}")
        time.sleep(1.0)
        assert model.snapshot_taken() and not model.done() and not state.done()
        assert not os.path.exists(os.path.join(tx.staging_dir, "model.safetensors"))
        tx.commit().result()
        assert model.done() and state.done()
        assert sorted(os.listdir(tmp_path / "checkpoint-1")) == [".asyncckpt-commit.json", "model.safetensors",
                                                                  "trainer_state.json"]
        other = checkpointer.begin_directory(tmp_path / "checkpoint-2", step=2)
        held = other.save_file({"x": torch.ones(3)}, "a.pt")
        held.result(timeout=60)  # waiting releases it: no hang without a commit
        assert os.path.exists(os.path.join(other.staging_dir, "a.pt"))
        other.commit().result()


class _FailsToCopy(torch.Tensor):
    """A tensor whose bytes cannot be copied (as a device error would do during a snapshot)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch._foreach_copy_:
            raise RuntimeError("copy failed")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_file_whose_snapshot_failed_fails_its_directory(tmp_path):
    with core.Checkpointer() as checkpointer:
        tx = checkpointer.begin_directory(tmp_path / "checkpoint-1", step=1)
        tx.save_file({"w": torch.ones(4)}, "config.pt")
        with pytest.raises(core.CheckpointWriteError, match=r"writing .*checkpoint-1/model\.safetensors \(step 1\) failed on rank 0: snapshot failed: RuntimeError: copy failed"):
            tx.save_file({"w": torch.ones(1 << 20).as_subclass(_FailsToCopy)}, "model.safetensors", format="safetensors")
        with pytest.raises(core.CheckpointWriteError, match="copy failed"):  # a commit anyway publishes nothing
            tx.commit().result()
    assert not os.path.exists(tmp_path / "checkpoint-1")


def test_torch_files_fall_back_to_plain_torch_save_where_the_fast_path_fails(tmp_path, monkeypatch, caplog):
    """The framing rendered once per structure rests on torch internals; if they do not behave as
    expected (checked once per process), files are plain ``torch.save`` output, with a warning."""
    def broken(records, capacity):
        raise AssertionError("torch's zip writer laid out data.pkl's record in an unexpected way")

    monkeypatch.setattr(torch_file, "render_template", broken)
    monkeypatch.setattr(torch_file, "_warned", False)
    torch_file._templates_work.cache_clear()
    try:
        state = {"w": torch.arange(6.0).reshape(2, 3), "step": 4}
        with caplog.at_level("WARNING", logger="asyncckpt.core"):
            with core.Checkpointer() as checkpointer:
                checkpointer.save_file(state, tmp_path / "plain.pt")
        assert "plain torch.save output" in caplog.text
        _assert_same(torch.load(tmp_path / "plain.pt", weights_only=True), state)
        reference = io.BytesIO()
        torch.save(state, reference)
        assert (tmp_path / "plain.pt").read_bytes() == reference.getvalue()
    finally:
        torch_file._templates_work.cache_clear()
