"""Tensor samples are collated natively: every torch dtype (bfloat16,
float16, bool, complex), non-contiguous tensors and tensors with autograd
history give what torch's default_collate gives (dtype for dtype, bit for
bit, the same structure), in-process and from thread and process workers,
without a per-sample conversion to numpy on the way (one torch.stack per
field, into the batch's buffer)."""
from __future__ import annotations

import collections
import functools

import fresh_python
import numpy as np
import pytest
from extras import deferred

import mxload
import mxload._torch_compat

torch = deferred("torch")
torch_collate = deferred("torch.utils.data._utils.collate")
mxtorch = deferred("mxload.torch")
cases = deferred("torch_tensors_cases")

pytestmark = [pytest.mark.torch, pytest.mark.timeout(60)]


def _same(got, want, path="batch"):
    """`got` is `want` as default_collate made it: types, dtypes, shapes, bytes."""
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{path}: {type(got).__name__}, expected an array"
        assert (got.dtype, got.shape) == (want.dtype, want.shape), \
            f"{path}: {got.dtype} {got.shape}, expected {want.dtype} {want.shape}"
        assert got.tobytes() == want.tobytes(), f"{path}: values differ"
        return
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: {type(got).__name__}, expected a tensor"
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype}, expected {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        a, b = got.detach().resolve_conj().resolve_neg(), want.detach().resolve_conj().resolve_neg()
        if a.is_complex():
            a, b = torch.view_as_real(a), torch.view_as_real(b)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), \
            f"{path}: values differ"
        return
    assert type(got) is type(want), f"{path}: {type(got).__name__}, expected {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), path
        for k in want:
            _same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


MODES = [pytest.param({}, id="in-process"),
         pytest.param({"num_workers": 2, "thread_pool": True}, id="threads"),
         pytest.param({"num_workers": 2, "multiprocessing_context": "fork"}, id="processes")]


@pytest.mark.parametrize("kw", MODES)
def test_every_dtype_collates_as_default_collate(kw):
    ds = cases.EveryDtype()
    with mxtorch.DataLoader(ds, batch_size=5, **kw) as loader:
        batches = list(loader)
    assert len(batches) == 3
    for b, batch in enumerate(batches):
        want = torch_collate.default_collate([ds[i] for i in range(5 * b, min(5 * b + 5, cases.N))])
        _same(batch, want)


@pytest.mark.parametrize("kw", MODES)
def test_no_sample_goes_through_numpy(kw, monkeypatch):
    """The tensor path converts no sample to numpy: with the conversion and
    Tensor.numpy() made to raise, the batches still come, equal to torch's."""

    def refuse(*_):
        raise AssertionError("a sample tensor was converted to numpy")

    monkeypatch.setattr(mxload._torch_compat, "tensor_to_numpy", refuse)
    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    ds = cases.EveryDtype()
    with mxtorch.DataLoader(ds, batch_size=4, **kw) as loader:
        batches = list(loader)
    for b, batch in enumerate(batches):
        _same(batch, torch_collate.default_collate([ds[i] for i in range(4 * b, 4 * b + 4)]))


@pytest.mark.parametrize("kw", MODES)
def test_autograd_history(kw):
    """In the training process (in-process, thread workers) a field whose
    samples carry autograd history is torch.stack's result with that
    history, as default_collate's; from worker processes (no graph crosses
    a process; torch's own workers raise there) it is the same values,
    detached."""
    ds = cases.EveryDtype(grad=True)
    with mxtorch.DataLoader(ds, batch_size=6, **kw) as loader:
        batches = list(loader)
    for b, batch in enumerate(batches):
        want = torch_collate.default_collate([ds[i] for i in range(6 * b, 6 * b + 6)])
        _same(batch, want)
        assert want["grad"].requires_grad
        if kw.get("thread_pool") or not kw:
            assert batch["grad"].requires_grad and batch["grad"].grad_fn is not None
            batch["grad"].sum().backward()
        else:
            assert not batch["grad"].requires_grad
    if not kw.get("num_workers") or kw.get("thread_pool"):
        assert ds.weight.grad is not None and ds.weight.grad.abs().sum() > 0


def test_numpy_loader_keeps_numpy_but_torch_only_dtypes():
    """mxload.DataLoader hands out numpy arrays for tensor fields numpy has a
    dtype for; a bfloat16 field (numpy has none) is a tensor."""
    samples = [{"x": torch.ones(2, dtype=torch.bfloat16) * i, "y": torch.ones(2) * i} for i in range(3)]
    out = mxload.batchify.default_batchify(samples)
    assert isinstance(out["y"], mxload.batchify.np.ndarray) and out["y"].dtype == "float32"
    assert isinstance(out["x"], torch.Tensor) and out["x"].dtype == torch.bfloat16
    assert out["x"].tolist() == [[0, 0], [1, 1], [2, 2]]


def test_mismatched_shapes_name_the_field():
    samples = [{"x": torch.zeros(3)}, {"x": torch.zeros(4)}]
    with pytest.raises(ValueError, match=r"batch 7, field sample\['x'\].*(size|shape).*Pad\(\)"):
        mxload.batchify.collate(mxload.batchify.default_batchify, samples, 7)


def test_mixed_dtypes_take_sample_0s_as_torchs_workers_do():
    """A float64 sample among float32 ones is cast into sample 0's dtype, as
    torch.stack into the batch's storage does in torch's worker processes;
    a cast torch refuses (float into an int64 batch) names the field."""
    out = mxload.batchify.default_batchify([torch.ones(2), torch.ones(2, dtype=torch.float64) / 3])
    assert out.dtype == "float32" and out[1, 0] == mxload.batchify.np.float32(1 / 3)
    with pytest.raises(TypeError, match=r"field sample.*Long|field sample.*int64"):
        mxload.batchify.default_batchify([torch.ones(2, dtype=torch.int64), torch.ones(2) / 3])


class _Rows:
    """Rows as torch users write them: a tuple of tensors (one bfloat16, one a
    transposed view), an int label, a float weight and a dict of tensors."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        image = torch.arange(12.0).reshape(3, 4).T + i
        return (image, torch.full((2,), i, dtype=torch.bfloat16), i, i / 3,
                {"mask": torch.tensor([i % 2 == 0, True]), "ids": torch.arange(3) * i})


@pytest.mark.parametrize("kw", MODES[:2])
def test_batches_kept_in_process_are_torch_stacks_without_a_plan(kw, monkeypatch):
    """Where the batch stays in the training process (no workers, thread workers), rows of
    CPU tensors and numbers are stacked by torch field by field, as default_collate does
    there: no plan, no buffer (planning is made to raise), torch's batches bit for bit."""

    def refuse(*_):
        raise AssertionError("a batch of tensor rows was planned")

    monkeypatch.setattr(mxload._collate.plan, "plan_batch", refuse)
    ds = _Rows()
    with mxtorch.DataLoader(ds, batch_size=4, **kw) as loader:
        batches = list(loader)
    assert len(batches) == 3
    for b, batch in enumerate(batches):
        _same(batch, torch_collate.default_collate([ds[i] for i in range(4 * b, min(4 * b + 4, 10))]))


Row = collections.namedtuple("Row", "x y")


# Each case's samples, made when its test runs (torch is imported only then).
STACKED_BY_THE_PLAN = {
    "shapes differ": lambda: [torch.zeros(3), torch.zeros(4)],
    "dtypes differ": lambda: [torch.ones(2), torch.ones(2, dtype=torch.float64)],
    "a numpy field": lambda: [(torch.ones(2), np.zeros(2))] * 2,
    "a namedtuple": lambda: [Row(torch.ones(2), 1)] * 2,
    "lengths differ": lambda: [(torch.ones(2), 1), (torch.ones(2), 1, 2)],
    "a tuple among lists": lambda: [[torch.ones(2), 1], (torch.ones(2), 1)],
    "a key missing": lambda: [{"x": torch.ones(2), "y": 1}, {"x": torch.ones(2), "z": 1}],
    "bools": lambda: [(torch.ones(2), True), (torch.ones(2), False)],
    "an int among floats": lambda: [(torch.ones(2), 1.5), (torch.ones(2), 2)],
    "an int too large": lambda: [(torch.ones(2), 2 ** 64), (torch.ones(2), 1)],
    "a Parameter": lambda: [torch.nn.Parameter(torch.ones(2))] * 2,
    "a string": lambda: [(torch.ones(2), "a"), (torch.ones(2), "b")],
}


@pytest.mark.parametrize("case", STACKED_BY_THE_PLAN)
def test_what_torch_alone_cannot_stack_is_planned(case):
    """stack_rows leaves a batch to the planned path where a row differs from row 0, a field
    is not a plain CPU tensor or a number, or torch would promote a dtype; the planned path
    then gives the batch it always gave (or names the field: shapes)."""
    samples = STACKED_BY_THE_PLAN[case]()
    assert mxload._torch_compat.stack_rows(samples) is None
    collate = mxload.batchify.torch_default_collate
    if case == "shapes differ":
        with pytest.raises(ValueError, match=r"batch 3, field sample.*Pad\(\)"):
            mxload.batchify.collate(collate, samples, 3)
        return
    try:
        batch = mxload.batchify.collate(collate, samples, 3)
    except (ValueError, TypeError, OverflowError) as e:
        assert "batch 3, field sample" in str(e), e
        return
    if case == "dtypes differ":   # sample 0's, as torch's workers stack into its storage
        assert batch.dtype == np.float32 and batch.shape == (2, 2)


def _clone_each(batch):
    return [t.clone() for t in batch]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("kw", MODES)
def test_nested_tensors_pass_a_custom_collate_and_default_collation_refuses_them_as_torch(kw):
    """A nested tensor (strided, but with no one shape) from a custom collate_fn arrives as itself;
    the default collation refuses a batch of them with torch's error (before: "NestedTensorImpl
    doesn't support sizes" from mxload's planning, either way)."""
    samples = [torch.nested.nested_tensor([torch.arange(i + 1.0), torch.ones(2)]) for i in range(4)]
    with mxtorch.DataLoader(samples, batch_size=2, collate_fn=_clone_each, **kw) as loader:
        got = [t for batch in loader for t in batch]
    assert len(got) == 4 and all(g.is_nested for g in got)
    for g, want in zip(got, samples):
        assert all(torch.equal(a, b) for a, b in zip(g.unbind(), want.unbind()))
    with mxtorch.DataLoader(samples, batch_size=2, **kw) as loader, \
            pytest.raises(RuntimeError, match=r"batch 0, field sample: Batches of nested tensors are "
                                              r"not currently supported by the default collate_fn"):
        next(iter(loader))


@pytest.mark.parametrize("kw", MODES)
def test_unbatched_tensors_copied_by_torch(kw):
    """batch_size=None: each sample's tensors are copied into the batch by
    torch (a bfloat16 one too), equal to torch's default_convert."""
    from torch.utils.data._utils.collate import default_convert
    ds = cases.EveryDtype()
    with mxtorch.DataLoader(ds, batch_size=None, **kw) as loader:
        got = list(loader)
    assert len(got) == cases.N
    for i, sample in enumerate(got):
        want = default_convert(ds[i])
        want["label"], want["name"] = sample["label"], sample["name"]   # numbers and strings: as they are
        _same(sample, want)


@pytest.mark.e2e
def test_a_worker_only_torch_dtype_reaches_a_main_process_without_torch():
    """A dataset that imports torch in its workers only: the main process
    has not imported torch when a bfloat16 field arrives; it imports it then
    and hands the field out as a bfloat16 tensor (failed before: KeyError 'torch').
    (End to end, in the e2e tier: two imports of torch, seconds; the default tier's
    test_every_dtype_collates_as_default_collate[processes] has bfloat16 from workers.)"""
    result = fresh_python.run("""
        class Lazy:
            def __len__(self):
                return 4

            def __getitem__(self, i):
                import torch
                return torch.full((2,), float(i), dtype=torch.bfloat16)

        with mxload.DataLoader(Lazy(), batch_size=2, num_workers=1) as loader:
            assert "torch" not in sys.modules
            batches = list(loader)
        print(type(batches[0]).__name__, batches[1].dtype, batches[1].tolist())
    """, timeout=50)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["Tensor", "torch.bfloat16", "[[2.0,", "2.0],", "[3.0,", "3.0]]"]


def _tensor_dataset(rows=50):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randn(rows, 3, 4, generator=g), torch.randint(0, 9, (rows,), generator=g),
        (torch.randn(rows, 2, generator=g) * 4).to(torch.bfloat16), torch.rand(rows, generator=g) > 0.5,
        torch.randn(rows, 2, dtype=torch.complex64, generator=g))


@pytest.mark.parametrize("kw", MODES)
def test_a_tensor_dataset_gives_torchs_batches_from_one_gather_per_tensor(kw, monkeypatch):
    """torch's TensorDataset: each of its tensors' rows of a batch are gathered in one go (its
    __getitem__, made to raise, is never called per index) and the batches are torch's
    DataLoader's bit for bit, shuffled by the same generator, the last one short."""
    ds = _tensor_dataset()
    want = list(torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True,
                                            generator=torch.Generator().manual_seed(5)))
    original = torch.utils.data.TensorDataset.__getitem__

    @functools.wraps(original)   # the same name: still torch's own __getitem__ to mxload
    def refuse(self, index):
        raise AssertionError(f"TensorDataset.__getitem__({index}) was called")

    monkeypatch.setattr(torch.utils.data.TensorDataset, "__getitem__", refuse)
    with mxtorch.DataLoader(ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5),
                            **kw) as loader:
        got = list(loader)
    assert len(got) == len(want) == 7
    for batch, expected in zip(got, want):
        _same(batch, expected)


def test_a_tensor_datasets_rows_are_fetched_per_index_where_a_gather_could_differ():
    """The gather is taken only for torch's own TensorDataset over plain CPU tensors it gives
    exactly: a subclass's __getitem__, a tensor with autograd history, a non-contiguous one and
    an index out of range are fetched per index (the dataset's own rows, or its own error)."""
    from mxload._collate.rows import TensorColumns
    from mxload._runtime.source import fetch_samples
    indices = np.array([4, 0, 7], dtype=np.int64)
    ds = _tensor_dataset(10)
    got = fetch_samples(ds, indices)
    assert isinstance(got, TensorColumns) and len(got) == 3
    for row, i in zip(got, indices.tolist()):   # read as rows: the dataset's own
        _same(list(row), list(ds[i]))

    class Doubled(torch.utils.data.TensorDataset):
        def __getitem__(self, i):
            return tuple(t[i] * 2 for t in self.tensors)

    x = torch.arange(20.0).reshape(10, 2)
    others = {"subclass": Doubled(x), "grad": torch.utils.data.TensorDataset(x.clone().requires_grad_()),
              "non-contiguous": torch.utils.data.TensorDataset(x.t().contiguous().t())}
    for name, other in others.items():
        fetched = fetch_samples(other, indices)
        assert type(fetched) is list, name
        assert [tuple(t.tolist() for t in r) for r in fetched] == \
            [tuple(t.tolist() for t in other[i]) for i in indices.tolist()], name
    with pytest.raises(IndexError, match="index 10 is out of bounds for dimension 0 with size 10"):
        fetch_samples(ds, np.array([1, 10], dtype=np.int64))


@pytest.mark.parametrize("kw", MODES)
def test_a_collate_fn_gets_a_tensor_datasets_rows_as_torch_passes_them(kw):
    """A user's collate_fn receives the list of row tuples, each ``dataset[i]``, as from torch."""
    ds = _tensor_dataset(12)

    def describe(rows):
        return [(type(rows).__name__, type(r).__name__, r[0].shape, int(r[1])) for r in rows]

    want = list(torch.utils.data.DataLoader(ds, batch_size=5, collate_fn=describe))
    with mxtorch.DataLoader(ds, batch_size=5, collate_fn=describe, **kw) as loader:
        assert list(loader) == want


@pytest.mark.parametrize("kw", MODES)
def test_what_a_collate_fn_returns_is_the_batch_as_torch_gives_it(kw):
    """torch hands out a collate_fn's result as it is: numpy arrays stay numpy arrays (JAX's
    numpy_collate with torch's loader), tensors of every dtype stay tensors, numbers stay
    numbers; through workers too (the tensors travel in shared memory, named as tensors)."""
    ds = _tensor_dataset(12)

    def numpy_and_tensors(rows):
        return (np.stack([r[0].numpy() for r in rows]), torch.stack([r[1] for r in rows]),
                {"bf16": torch.stack([r[2] for r in rows]), "mask": torch.stack([r[3] for r in rows]),
                 "ids": np.array([int(r[1]) for r in rows], np.int32)},
                [np.int64(len(rows)), 2.5, "tag"])

    want = list(torch.utils.data.DataLoader(ds, batch_size=5, collate_fn=numpy_and_tensors))
    with mxtorch.DataLoader(ds, batch_size=5, collate_fn=numpy_and_tensors, **kw) as loader:
        got = list(loader)
    assert len(got) == len(want) == 3
    for batch, expected in zip(got, want):
        _same(batch, expected)
        assert type(batch[3][0]) is np.int64 and batch[3][1:] == [2.5, "tag"]

    def one_sample(row):   # batch_size=None: torch calls collate_fn with the sample itself
        return row[0].numpy() * 2, row[1], {"n": np.float32(1.5)}

    want = list(torch.utils.data.DataLoader(ds, batch_size=None, collate_fn=one_sample))
    with mxtorch.DataLoader(ds, batch_size=None, collate_fn=one_sample, **kw) as loader:
        got = list(loader)
    assert len(got) == len(want) == 12
    for batch, expected in zip(got, want):
        _same(batch, expected)


@pytest.mark.parametrize("kw", MODES)
def test_a_collate_fns_batch_is_not_gathered_first(kw, monkeypatch):
    """A user's collate_fn is given the rows, so its batch is fetched as rows: gathering the
    columns first (as the default collation wants them) would be work thrown away.  The gather
    raises here (fork workers inherit that), and the default collation still takes it."""
    def no_gather(dataset, indices):
        raise AssertionError("a collate_fn's batch was gathered")

    monkeypatch.setattr(mxload._torch_compat, "gather_tensor_dataset", no_gather)
    ds = _tensor_dataset(12)
    want = list(torch.utils.data.DataLoader(ds, batch_size=5, collate_fn=list))
    with mxtorch.DataLoader(ds, batch_size=5, collate_fn=list, **kw) as loader:
        got = list(loader)
    assert len(got) == len(want) == 3
    for rows, expected in zip(got, want):
        assert len(rows) == len(expected)
        for row, other in zip(rows, expected):
            _same(list(row), list(other))
    with mxtorch.DataLoader(ds, batch_size=5, **kw) as loader, \
            pytest.raises(AssertionError, match="a collate_fn's batch was gathered"):
        list(loader)


@pytest.mark.parametrize("kw", MODES)
def test_a_tensor_datasets_batch_of_any_index_array_is_torchs(kw):
    """The indices a batch_sampler yields reach the gather as it gave them: a reversed numpy
    array (negative strides, which torch.from_numpy refuses) gives torch's batch, as do
    indices of any integer dtype (a byte array is indices, never torch's boolean-like mask)
    and negative indices (counted from the end, as ``tensor[i]`` takes them)."""
    from mxload._torch_compat import gather_tensor_dataset
    ds = torch.utils.data.TensorDataset(torch.arange(12.0).reshape(6, 2), torch.arange(6))
    batches = [np.arange(6)[::-1], np.arange(5)[::-2], np.array([2, 0], dtype=">i8"), [-1, 0, -6]]
    want = list(torch.utils.data.DataLoader(ds, batch_sampler=batches))
    with mxtorch.DataLoader(ds, batch_sampler=batches, **kw) as loader:
        got = list(loader)
    assert len(got) == len(want) == 4
    for batch, expected in zip(got, want):
        _same(batch, expected)
    for dtype in (np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32, np.uint64):
        indices = np.array([1, 0, 0, 0, 0, 1], dtype=dtype)
        gathered = gather_tensor_dataset(ds, indices)
        if gathered is not None:
            assert gathered[1].tolist() == [1, 0, 0, 0, 0, 1], dtype
