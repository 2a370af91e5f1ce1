"""MeshLayout against a brute-force reference built from itertools, plus its error messages."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devmesh.errors import MeshDimNameError, MeshRankError, MeshShapeError
from devmesh.layout import MeshLayout


# -- brute-force reference: explicit coordinates, no numpy reshaping ------------------------
def ref_rank_at(shape, ranks_flat, coord):
    index = 0
    for c, s in zip(coord, shape):
        index = index * s + c
    return ranks_flat[index]


def ref_groups(shape, ranks_flat, dims):
    rest = [d for d in range(len(shape)) if d not in dims]
    out = []
    for fixed in itertools.product(*[range(shape[d]) for d in rest]):
        group = []
        for varying in itertools.product(*[range(shape[d]) for d in dims]):
            coord = [0] * len(shape)
            for d, c in zip(rest, fixed):
                coord[d] = c
            for d, c in zip(dims, varying):
                coord[d] = c
            group.append(ref_rank_at(shape, ranks_flat, coord))
        out.append(tuple(group))
    return out


@st.composite
def layouts(draw, max_dims=5, max_ranks=4096):
    ndim = draw(st.integers(1, max_dims))
    shape = []
    for _ in range(ndim):
        budget = max_ranks // max(1, math.prod(shape))
        shape.append(draw(st.integers(1, max(1, min(8, budget)))))
    names = draw(
        st.one_of(
            st.none(),
            st.lists(st.text("abcdefgh", min_size=1, max_size=3), min_size=ndim,
                     max_size=ndim, unique=True),
        )
    )
    size = math.prod(shape)
    if draw(st.booleans()):
        ranks = list(range(size))
    else:
        pool = draw(st.permutations(range(size * 2)))
        ranks = list(pool[:size])
    return tuple(shape), names, ranks


@settings(max_examples=150, deadline=None)
@given(layouts(), st.data())
def test_groups_and_coordinates_match_reference(spec, data):
    shape, names, ranks = spec
    layout = MeshLayout(shape, names, ranks)
    assert layout.shape == shape and layout.size == len(ranks)
    k = data.draw(st.integers(1, len(shape)))
    dims = tuple(data.draw(st.permutations(range(len(shape))))[:k])
    expected = ref_groups(shape, ranks, dims)
    assert layout.groups(dims) == expected
    if names:
        assert layout.groups(tuple(names[d] for d in dims)) == expected
    rank = data.draw(st.sampled_from(ranks))
    coord = layout.coordinate_of(rank)
    assert ref_rank_at(shape, ranks, coord) == rank
    assert layout.rank_at(coord) == rank
    group = layout.group_of(rank, dims)
    assert group in expected and rank in group
    assert expected[layout.group_index(rank, dims)] == group
    missing = max(ranks) + 1
    assert layout.coordinate_of(missing) is None and missing not in layout


@settings(max_examples=100, deadline=None)
@given(layouts(max_dims=4, max_ranks=512), st.data())
def test_slice_flatten_unflatten_match_reference(spec, data):
    shape, names, ranks = spec
    names = names or [f"d{i}" for i in range(len(shape))]
    layout = MeshLayout(shape, names, ranks)
    k = data.draw(st.integers(1, len(shape)))
    dims = tuple(data.draw(st.permutations(range(len(shape))))[:k])
    rank = data.draw(st.sampled_from(ranks))

    sub = layout.slice([names[d] for d in dims], rank=rank)
    assert sub.shape == tuple(shape[d] for d in dims)
    assert sub.names == tuple(names[d] for d in dims)
    assert tuple(sub.rank_list()) == layout.group_of(rank, dims)
    for s in layout.submeshes(dims):
        assert tuple(s.rank_list()) in ref_groups(shape, ranks, dims)

    flat = layout.flatten(dims)
    merged = "_".join(names[d] for d in dims)
    assert merged in flat.names and flat.ndim == len(shape) - k + 1
    # the flattened dim's groups are exactly the groups along the original dims
    assert sorted(flat.groups(merged)) == sorted(ref_groups(shape, ranks, dims))
    # every other dim keeps its groups, each in the same rank order
    for d in range(len(shape)):
        if d not in dims:
            assert sorted(flat.groups(names[d])) == sorted(ref_groups(shape, ranks, (d,)))

    d = data.draw(st.integers(0, len(shape) - 1))
    factors = [f for f in range(1, shape[d] + 1) if shape[d] % f == 0]
    a = data.draw(st.sampled_from(factors))
    un = layout.unflatten(names[d], (a, shape[d] // a), ("u0x", "u1x"))
    assert un.rank_list() == layout.rank_list()
    assert un.flatten(("u0x", "u1x"), names[d]) == layout


def test_seed_examples():
    two_by_three = MeshLayout((2, 3), ("dp", "tp"))
    assert two_by_three.groups("tp") == [(0, 1, 2), (3, 4, 5)]
    three_by_two = MeshLayout((3, 2), ("dp", "tp"))
    assert three_by_two.groups("tp") == [(0, 1), (2, 3), (4, 5)]
    hsdp = MeshLayout((2, 4), ("replicate", "shard"))
    assert hsdp.groups("shard") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert hsdp.groups("replicate") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    cube = MeshLayout((2, 2, 2), ("dp", "cp", "tp"))
    # torch's docstring: mesh_3d["dp", "cp"] on rank 0 -> [[0, 2], [4, 6]] (row-major dims)
    assert cube.slice(("dp", "cp"), rank=0).ranks.tolist() == [[0, 2], [4, 6]]
    assert cube.slice(("cp", "dp"), rank=0).ranks.tolist() == [[0, 4], [2, 6]]
    assert cube.flatten(("dp", "cp")).groups("dp_cp") == [(0, 2, 4, 6), (1, 3, 5, 7)]


def test_value_semantics():
    a = MeshLayout((2, 2), ("x", "y"))
    assert a == MeshLayout((2, 2), ("x", "y"), [[0, 1], [2, 3]])
    assert hash(a) == hash(MeshLayout((2, 2), ("x", "y")))
    assert a != MeshLayout((2, 2), ("x", "z"))
    assert a != MeshLayout((2, 2), ("x", "y"), [[0, 1], [3, 2]])
    assert len({a, MeshLayout((2, 2), ("x", "y")), MeshLayout((4,))}) == 2
    with pytest.raises(ValueError):
        a.ranks[0, 0] = 5  # read-only
    import pickle

    assert pickle.loads(pickle.dumps(a)) == a


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(shape=(2, 0)), MeshShapeError, "positive integer"),
        (dict(shape=(2, -1)), MeshShapeError, "positive integer"),
        (dict(shape=(2.5,)), MeshShapeError, "positive integer"),
        (dict(shape=()), MeshShapeError, "at least one"),
        (dict(shape=(2, 2), names=("a",)), MeshDimNameError, "1 names for a 2-D"),
        (dict(shape=(2, 2), names=("a", "a")), MeshDimNameError, "repeats 'a'"),
        (dict(ranks=[0, 1, 1]), MeshShapeError, "rank 1 appears more than once"),
        (dict(ranks=[0, -1]), MeshShapeError, "non-negative"),
        (dict(ranks=[[0, 1], [2]]), MeshShapeError, "rectangular"),
        (dict(shape=(2, 2), ranks=[0, 1, 2]), MeshShapeError, "3 entries"),
    ],
)
def test_bad_input_errors(kwargs, error, words):
    with pytest.raises(error, match=words):
        MeshLayout(**kwargs)


def test_dim_errors_list_valid_names():
    layout = MeshLayout((2, 4), ("dp", "tp"))
    with pytest.raises(MeshDimNameError, match="valid names are 'dp', 'tp'") as info:
        layout.groups("pp")
    assert isinstance(info.value, KeyError)
    assert "KeyError" not in str(info.value) and not str(info.value).startswith("'")
    with pytest.raises(MeshDimNameError, match="no dimension names"):
        MeshLayout((2, 4)).groups("tp")
    with pytest.raises(MeshDimNameError, match="out of range"):
        layout.groups(2)
    with pytest.raises(MeshRankError, match="rank 9 is not in this mesh"):
        layout.group_of(9, "tp")
    with pytest.raises(MeshShapeError, match="multiply to 6"):
        layout.unflatten("tp", (2, 3), ("a", "b"))


def test_million_rank_mesh_groups():
    # Speed is measured by bench/mesh_init.py; here only the result of the big case.
    layout = MeshLayout((128, 128, 64), ("dp", "fsdp", "tp"))
    groups = [layout.groups(d) for d in layout.names]
    assert [len(g) for g in groups] == [128 * 64, 128 * 64, 128 * 128]
    assert groups[2][1] == tuple(range(64, 128))
    assert groups[0][0] == tuple(range(0, 128 * 128 * 64, 128 * 64))
