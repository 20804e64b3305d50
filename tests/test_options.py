"""LoaderOptions (every DataLoader argument checked once, in mxload._options)
and check_int (the one integer check of the package's public arguments)."""
from __future__ import annotations

import dataclasses
import multiprocessing
import re

import numpy as np
import pytest

import mxload
from mxload import batchify
from mxload._checks import check_int
from mxload._options import LoaderOptions
from mxload.sampler import BatchSampler, SequentialSampler

DATA = mxload.SimpleDataset(list(range(10)))


class Stream(mxload.IterableDataset):
    def __iter__(self):
        return iter(range(5))


# ------------------------------------------------------------------ check_int


@pytest.mark.parametrize("value", [3, np.int64(3), np.uint8(3)])
def test_check_int_accepts_python_and_numpy_integers(value):
    out = check_int("n", value, 1)
    assert out == 3 and type(out) is int


@pytest.mark.parametrize("value", [True, np.bool_(False), 2.0, 2.5, "2", None, np.float32(1)])
def test_check_int_refuses_bools_floats_and_strings(value):
    with pytest.raises(ValueError, match=rf"^n must be an integer, got {value!r}$".replace("(", r"\(")
                       .replace(")", r"\)")):
        check_int("n", value)


@pytest.mark.parametrize("minimum,allowed", [(0, "a non-negative integer"), (1, "a positive integer"),
                                             (2, "an integer >= 2"), (-1, "an integer >= -1")])
def test_check_int_names_the_argument_what_is_allowed_and_the_value(minimum, allowed):
    assert check_int("k", minimum, minimum) == minimum
    with pytest.raises(ValueError, match=f"^k must be {allowed}, got {minimum - 1}$"):
        check_int("k", minimum - 1, minimum)
    with pytest.raises(ValueError, match=f"^k must be {allowed} or None \\(hint\\), got 'x'$"):
        check_int("k", "x", minimum, or_none=True, hint=" (hint)")


# Every integer argument of DataLoader, refused in the one message style.
@pytest.mark.parametrize("kwargs,message", [
    (dict(batch_size=0), "batch_size must be a positive integer or None, got 0"),
    (dict(batch_size=2.0), "batch_size must be a positive integer or None, got 2.0"),
    # A negative count in torch's words ("num_workers option should be non-negative"): programs match them.
    (dict(num_workers=-1), "num_workers option should be non-negative (use num_workers=0 to load in the "
                           "main process), got -1"),
    (dict(num_workers=True), "num_workers must be a non-negative integer (use num_workers=0 to load in the "
                             "main process), got True"),
    (dict(prefetch=0), "prefetch must be a positive integer or None, got 0"),
    (dict(num_workers=1, prefetch_factor=0), "prefetch_factor must be a positive integer, got 0"),
    (dict(seed=-3), "seed must be a non-negative integer or None, got -3"),
    (dict(seed=1.5), "seed must be a non-negative integer or None, got 1.5"),
    (dict(max_worker_restarts=-1), "max_worker_restarts must be a non-negative integer, got -1"),
    (dict(pin_device_id=np.bool_(True)),
     f"pin_device_id must be a non-negative integer, got {np.bool_(True)!r}"),
])
def test_every_integer_argument_is_refused_in_one_style(kwargs, message):
    with pytest.raises(ValueError) as info:
        LoaderOptions.from_arguments(DATA, **kwargs)
    assert str(info.value) == message
    with pytest.raises(ValueError) as info:   # the DataLoader reports exactly what the options do
        mxload.DataLoader(DATA, **kwargs)
    assert str(info.value) == message


def test_sampler_integers_use_the_same_check():
    with pytest.raises(ValueError, match="^batch_size must be a positive integer, got 0$"):
        BatchSampler(SequentialSampler(3), 0)
    with pytest.raises(ValueError, match="^n must be a non-negative integer, got 2.5$"):
        SequentialSampler(2.5)


# ------------------------------------------------------------------ resolved values


def test_defaults_are_resolved():
    o = LoaderOptions.from_arguments(DATA)
    batching, workers = o.batching, o.workers
    assert (batching.batch_size, o.derived.fetch_batch_size, batching.last_batch, batching.drop_last) == \
        (1, 1, "keep", False)
    assert batching.batchify_fn is batchify.default_batchify
    assert o.torch.collate_fn is batchify.default_batchify
    assert (workers.num_workers, workers.prefetch, o.torch.prefetch_factor, workers.timeout) == \
        (0, 2, None, 120)
    assert o.derived.auto_batching and not o.derived.iterable and not batching.shuffle
    assert isinstance(o.seeds.seed, int) and 0 <= o.seeds.seed < 2 ** 63 and o.seeds.distributed_seed == 0


def test_torch_aliases_are_resolved():
    fn = batchify.Stack()
    spawn = multiprocessing.get_context("spawn")
    o = LoaderOptions.from_arguments(DATA, batch_size=3, collate_fn=fn, drop_last=True, num_workers=2,
                                     prefetch_factor=3, multiprocessing_context=spawn, timeout=0)
    assert o.batching.batchify_fn is fn and o.torch.collate_fn is fn
    assert o.batching.last_batch == "discard" and o.batching.drop_last
    assert (o.workers.prefetch, o.torch.prefetch_factor) == (6, 3)
    assert o.workers.start_method == "spawn" and o.workers.timeout is None   # 0 is torch's "no timeout"
    assert o.torch.multiprocessing_context is spawn   # torch's view: as given


def test_batching_modes():
    unbatched = LoaderOptions.from_arguments(DATA, batch_size=None)
    assert not unbatched.derived.auto_batching and unbatched.derived.fetch_batch_size == 1
    assert unbatched.torch.collate_fn is batchify.default_convert
    assert unbatched.batching.batchify_fn is not batchify.default_convert   # wrapped: one sample, not a list
    sampled = LoaderOptions.from_arguments(DATA, batch_sampler=[[0, 1], [2]])
    assert sampled.batching.batch_size is None and sampled.derived.fetch_batch_size == 0
    assert sampled.derived.auto_batching
    stream = LoaderOptions.from_arguments(Stream(), batch_size=2)
    assert stream.derived.iterable and stream.derived.fetch_batch_size == 2


def test_seeds():
    assert LoaderOptions.from_arguments(DATA, seed=np.int64(7)).seeds.seed == 7
    o = LoaderOptions.from_arguments(DATA, seed=7, distributed=True)
    assert (o.seeds.seed, o.seeds.distributed_seed) == (7, 7)
    with pytest.raises(ValueError, match="pass seed or generator, not both"):
        LoaderOptions.from_arguments(DATA, seed=1, generator=object())


def test_options_are_frozen():
    o = LoaderOptions.from_arguments(DATA, num_workers=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.workers.num_workers = 2   # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.dataset = DATA   # type: ignore[misc]


def test_loader_attributes_read_and_replace_the_options():
    loader = mxload.DataLoader(DATA, batch_size=5, num_workers=1, timeout=30)
    before = loader._options
    assert loader.num_workers == 1 and loader.timeout == 30 and loader.prefetch == 2
    loader.num_workers = 0     # torch allows it: the next epoch runs in-process
    assert loader._options is not before and loader._options.workers.num_workers == 0
    assert before.workers.num_workers == 1
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    with pytest.raises(ValueError, match="batch_size attribute should not be set"):
        loader.batch_size = 3
    assert loader._options.batching.batch_size == 5


def test_a_field_is_found_by_its_name_alone_in_its_group():
    """LoaderOptions.value and replaced (what the DataLoader's attributes read and set) find a
    field in whichever group holds it; no name is in two groups, and every option attribute of
    the DataLoader names a field."""
    from mxload._options import _GROUP_OF, _GROUPS
    from mxload.dataloader import _Option, _Settings
    assert len(_GROUP_OF) == sum(len(dataclasses.fields(kind)) for kind in _GROUPS.values())
    assert not set(_GROUP_OF) & {f.name for f in dataclasses.fields(LoaderOptions)}
    o = LoaderOptions.from_arguments(DATA, num_workers=2, seed=3)
    options = [option._field for option in vars(_Settings).values() if isinstance(option, _Option)]
    assert len(options) > 20
    for field in options:
        o.value(field)   # (AttributeError for a name in no group)
    with pytest.raises(AttributeError):
        o.value("no_such_field")
    changed = o.replaced(seed=5, num_workers=0, profile=True)
    assert (changed.seeds.seed, changed.workers.num_workers, changed.profile) == (5, 0, True)
    assert (o.seeds.seed, o.workers.num_workers, o.profile) == (3, 2, False)
    assert changed.batching is o.batching   # the groups not changed are shared
    with pytest.raises(TypeError):
        o.replaced(no_such_field=1)


def test_checks_run_in_a_fixed_order():
    # Several mistakes: the first check (an argument's kind) is the one reported.
    with pytest.raises(TypeError, match="batchify_fn must be callable"):
        LoaderOptions.from_arguments(DATA, batch_size=0, num_workers=-1, batchify_fn=3)
    with pytest.raises(ValueError, match="num_workers"):
        LoaderOptions.from_arguments(DATA, batch_size=0, num_workers=-1)


# ------------------------------------------------------------------ switches and keyword names


SWITCHES = ["shuffle", "drop_last", "pin_memory", "thread_pool", "auto_reload", "persistent_workers",
            "in_order", "profile", "distributed", "try_nopython"]


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("value", ["no", "yes", 1, 0, 1.0, [True]])
def test_a_switch_that_is_no_bool_is_a_type_error_naming_it(name, value):
    """in_order="no" and shuffle="yes" were accepted (any truthy value meant True)."""
    with pytest.raises(TypeError, match=re.escape(f"{name} must be True or False, got {value!r}")) as info:
        mxload.DataLoader(DATA, batch_size=2, **{name: value})
    assert ("would have meant True" in str(info.value)) == isinstance(value, str)


@pytest.mark.parametrize("name", SWITCHES)
def test_a_switch_takes_numpy_bools(name):
    kwargs = {name: np.bool_(False)}
    loader = mxload.DataLoader(DATA, batch_size=2, **kwargs)
    assert name == "drop_last" or loader._options.value(name) is False
    assert len(list(loader)) == 5


@pytest.mark.parametrize("kwargs", [dict(in_order="no"), dict(shuffle="yes"), dict(shuffle=1),
                                    dict(pin_memory="no"), dict(drop_last="no"),
                                    dict(drop_last=np.bool_(True)), dict(drop_last=1),
                                    dict(persistent_workers="yes", num_workers=1)])
@pytest.mark.torch
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")
def test_the_torch_face_takes_switches_as_torch_does(kwargs):
    """torch takes any truthy value, but for drop_last (its BatchSampler's ValueError)."""
    torch_data = pytest.importorskip("torch.utils.data")
    import mxload.torch as mxtorch

    def outcome(loader_class):
        try:
            loader = loader_class(list(range(8)), batch_size=4, **kwargs)
        except (TypeError, ValueError) as e:
            return type(e), str(e)
        try:
            return sorted(int(x) for batch in loader for x in batch)
        finally:
            close = getattr(loader, "close", None)   # mxload's persistent workers (torch's end with it)
            if close is not None:
                close()

    assert outcome(mxtorch.DataLoader) == outcome(torch_data.DataLoader)


@pytest.mark.parametrize("typo, meant", [("num_worker", "num_workers"), ("batchsize", "batch_size"),
                                         ("shuffel", "shuffle"), ("colate_fn", "collate_fn"),
                                         ("prefetch_factors", "prefetch_factor"), ("inorder", "in_order")])
@pytest.mark.parametrize("face", ["mxload", pytest.param("mxload.torch", marks=pytest.mark.torch)])
def test_a_misspelled_keyword_names_the_nearest(face, typo, meant):
    if face == "mxload.torch":
        pytest.importorskip("torch")
        import mxload.torch as mxtorch
        loader_class = mxtorch.DataLoader
    else:
        loader_class = mxload.DataLoader
    with pytest.raises(TypeError, match=rf"^DataLoader\(\) got an unexpected keyword argument '{typo}'; "
                                        rf"did you mean '{meant}'\?$"):
        loader_class(DATA, **{typo: 2})


def test_an_unknown_keyword_with_nothing_near_is_pythons_error():
    with pytest.raises(TypeError, match=r"^DataLoader\(\) got an unexpected keyword argument 'frobnicate'$"):
        mxload.DataLoader(DATA, frobnicate=True)
