"""A Hugging Face ``datasets.Dataset`` fetches a batch as a dict of columns and splits it into rows
(its ``__getitems__``); mxload fetches it the same way and keeps it unsplit
(mxload._collate.rows.RowsOfColumns), so default collation copies each tensor column once.
What the user sees does not change: torch's batches bit for bit, a custom ``collate_fn`` gets the
very list of row dicts, a subclass's own ``__getitems__`` is called, errors name the field."""
from __future__ import annotations

import numpy as np
import pytest
from extras import deferred
from test_torch_tensors import MODES, _same

import mxload
from mxload._collate.rows import RowsOfColumns, fetches_columns
from mxload._runtime.source import fetch_samples
from mxload.batchify import default_batchify

torch = deferred("torch")
tud = deferred("torch.utils.data")
mxtorch = deferred("mxload.torch")

pytestmark = [pytest.mark.torch, pytest.mark.timeout(60)]

N = 37


def _columns(n=N):
    g = torch.Generator().manual_seed(7)
    return {"x": torch.randn(n, 6, generator=g), "image": torch.randint(0, 255, (n, 3, 4, 4), generator=g),
            "label": torch.arange(n), "half": torch.randn(n, 2, generator=g).to(torch.bfloat16)}


# ------------------------------------------------------------------ collation of kept columns


def _rows_both_ways(batch):
    n = len(next(iter(batch.values())))
    kept = RowsOfColumns(batch, n)
    return kept, [{k: v[i] for k, v in batch.items()} for i in range(n)]


def test_kept_columns_collate_to_the_rows_default_collate():
    """Every kind of column: tensors of any rank and dtype (copied once), and strings, numbers,
    a tensor with autograd history and a list of tensors (planned from their rows)."""
    batch = _columns(5)
    batch.update(text=[f"t{i}" for i in range(5)], score=[0.5 * i for i in range(5)],
                 grad=torch.ones(5, 2, requires_grad=True) * 3,
                 pieces=[torch.full((3,), i) for i in range(5)])
    kept, rows = _rows_both_ways(batch)
    assert len(kept) == 5 and list(kept[2]) == list(rows[2]) and kept[2]["text"] == "t2"
    got, want = default_batchify(kept), default_batchify(rows)
    assert list(got) == list(want)
    for key in want:
        g, w = got[key], want[key]
        assert type(g) is type(w), key
        if isinstance(w, np.ndarray):
            assert (g.dtype, g.shape, g.tobytes()) == (w.dtype, w.shape, w.tobytes()), key
        elif isinstance(w, torch.Tensor):
            _same(g, w, key)
        else:
            assert g == w, key
    assert got["half"].dtype == torch.bfloat16 and got["x"].dtype == np.float32
    assert got["grad"].requires_grad, "a column with autograd history goes the rows' way"


def test_a_user_collate_fn_gets_the_datasets_own_list_of_rows():
    kept, rows = _rows_both_ways(_columns(4))
    seen = []
    mxload.batchify.collate(lambda samples: seen.append(samples) or 0, kept)
    assert type(seen[0]) is list and len(seen[0]) == 4
    for got, want in zip(seen[0], rows):
        _same(got, want)


def test_a_column_whose_rows_differ_is_the_rows_error_naming_the_field():
    batch = {"x": torch.zeros(3, 2), "ragged": [torch.zeros(2), torch.zeros(2), torch.zeros(5)]}
    kept, rows = _rows_both_ways(batch)
    with pytest.raises(ValueError) as by_columns:
        default_batchify(kept)
    with pytest.raises(ValueError) as by_rows:
        default_batchify(rows)
    assert str(by_columns.value) == str(by_rows.value)
    assert "['ragged']" in str(by_columns.value)


# ------------------------------------------------------------------ with Hugging Face datasets


@pytest.fixture(scope="module")
def hf_dataset():
    datasets = pytest.importorskip("datasets", reason="needs Hugging Face datasets")
    cols = {k: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy() for k, v in _columns().items()}
    cols["text"] = [f"row {i}" for i in range(N)]
    import tqdm
    # datasets' first fetch makes a tqdm bar, whose monitor thread would outlive the module
    # (and make later tests' thread counts wrong): no monitor thread meanwhile.
    interval, tqdm.tqdm.monitor_interval = tqdm.tqdm.monitor_interval, 0
    yield datasets.Dataset.from_dict(cols).with_format("torch")
    tqdm.tqdm.monitor_interval = interval


def test_only_hugging_faces_own_getitems_is_fetched_as_columns(hf_dataset):
    import datasets

    class Mine(datasets.Dataset):
        def __getitems__(self, keys):
            return [{"mine": k} for k in keys]

    assert fetches_columns(hf_dataset)
    mine = Mine(hf_dataset.data)
    assert not fetches_columns(mine) and not fetches_columns(mxload.ArrayDataset(np.zeros(3)))
    got = fetch_samples(hf_dataset, np.array([3, 1, 4]))
    assert isinstance(got, RowsOfColumns)
    want = hf_dataset.__getitems__([3, 1, 4])
    assert len(got.rows()) == 3
    for g, w in zip(got.rows(), want):
        _same(g, w)
    assert fetch_samples(mine, np.array([2, 0])) == [{"mine": 2}, {"mine": 0}]


@pytest.mark.parametrize("kw", MODES)
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_hugging_face_dataset_gives_torchs_batches(hf_dataset, kw, shuffle):
    def run(loader_class, extra):
        loader = loader_class(hf_dataset, batch_size=8, shuffle=shuffle,
                              generator=torch.Generator().manual_seed(3), **extra)
        return list(loader)

    want = run(tud.DataLoader, {})
    got = run(mxtorch.DataLoader, kw)
    assert len(got) == len(want) == 5
    for b, (g, w) in enumerate(zip(got, want)):
        _same(g, w, f"batch {b}")


@pytest.mark.parametrize("kw", MODES)
def test_a_custom_collate_fn_of_a_hugging_face_dataset_gets_its_rows(hf_dataset, kw):
    def names(rows):
        assert type(rows) is list and all(type(r) is dict for r in rows)
        return [r["text"] for r in rows]

    loader = mxtorch.DataLoader(hf_dataset, batch_size=10, collate_fn=names, **kw)
    assert [t for batch in loader for t in batch] == [f"row {i}" for i in range(N)]


def test_a_contiguous_run_of_rows_is_fetched_as_a_slice_and_gives_the_same_batches(hf_dataset, monkeypatch):
    """Unshuffled batches ask datasets for a slice (one Arrow slice, ~5x cheaper than a gather
    of each row), shuffled ones for the list; both give torch's batches; so does a dataset with
    an indices mapping (select), and a subclass's own __getitem__ still gets the list."""
    import datasets

    keys = []
    real = datasets.Dataset._getitem
    monkeypatch.setattr(datasets.Dataset, "_getitem",
                        lambda self, key, **kw: keys.append(key) or real(self, key, **kw))
    for shuffle in (False, True):
        keys.clear()
        loader = mxtorch.DataLoader(hf_dataset, batch_size=8, shuffle=shuffle)
        got = list(loader)
        kinds = {type(k) for k in keys}
        assert kinds == ({list} if shuffle else {slice}), kinds
        assert len(got) == 5
    remapped = hf_dataset.select(list(range(N - 1, -1, -1)))
    for g, w in zip(mxtorch.DataLoader(remapped, batch_size=8), tud.DataLoader(remapped, batch_size=8)):
        _same(g, w)

    class Mine(datasets.Dataset):
        def __getitem__(self, key):
            assert isinstance(key, list), key
            return super().__getitem__(key)

    mine = Mine(hf_dataset.data).with_format("torch")
    assert len(list(mxtorch.DataLoader(mine, batch_size=8))) == 5


def test_shuffled_rows_are_gathered_in_one_chunk_and_read_as_the_datasets_own(hf_dataset, monkeypatch):
    """A shuffled batch's rows are gathered as datasets' own _getitem gathers them, then joined
    into one Arrow chunk before datasets formats them (it formats a column chunk by chunk, one
    chunk per gathered row): the rows are the dataset's own __getitems__'s, bit for bit, in every
    format, with an indices mapping, a column subset, a transform and a fixed-shape array feature."""
    import datasets
    import datasets.formatting

    formatted = []   # (rows, chunks) of each table mxload has datasets format
    real = datasets.formatting.format_table
    monkeypatch.setattr(datasets.formatting, "format_table", lambda table, *a, **k: formatted.append(
        (table.num_rows, table.column(0).num_chunks)) or real(table, *a, **k))
    grid = datasets.Dataset.from_dict(
        {"m": np.arange(N * 6, dtype=np.float32).reshape(N, 2, 3), "k": list(range(N))},
        features=datasets.Features({"m": datasets.Array2D((2, 3), "float32"), "k": datasets.Value("int32")}))
    variants = {
        "torch": hf_dataset, "numpy": hf_dataset.with_format("numpy"), "python": hf_dataset.with_format(None),
        "indices mapping": hf_dataset.shuffle(seed=0),
        "columns": hf_dataset.with_format("torch", columns=["x", "label"], output_all_columns=True),
        "transform": hf_dataset.with_transform(lambda b: {"twice": [2 * v for v in b["label"]]}),
        "array2d": grid.with_format("torch")}
    keys = [5, 30, 2, 2, 17, 0, 36]
    for name, ds in variants.items():
        formatted.clear()
        got = RowsOfColumns.fetch(ds, keys)
        assert formatted == [(len(keys), 1)], name   # gathered, then formatted in one chunk
        _same(got.rows() if isinstance(got, RowsOfColumns) else got, ds.__getitems__(keys), name)
    with pytest.raises(IndexError):   # datasets' own error for a row out of range
        RowsOfColumns.fetch(hf_dataset, [1, N])
