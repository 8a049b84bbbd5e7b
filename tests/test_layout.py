"""Rank layouts: lookup namespaces cover every namespace a rank writes (and so loads)."""

import itertools

import pytest

import mooncake_keys as mk


def layouts():
    for tp, pp, heads, mla in itertools.product(range(1, 9), (1, 2), (1, 2, 3, 4, 8, 16), (False, True)):
        h = 1 if mla else heads
        if tp % h and h % tp:
            continue
        yield mk.ParallelLayout(tp_size=tp, pp_size=pp, num_kv_heads=heads, use_mla=mla)
        yield mk.ParallelLayout(tp_size=tp, pp_size=pp, pcp_size=2, num_kv_heads=heads, use_mla=mla)
        for dcp in (2, 4, 8):
            if tp % dcp == 0:
                yield mk.ParallelLayout(tp_size=tp, pp_size=pp, dcp_size=dcp, num_kv_heads=heads, use_mla=mla)


@pytest.mark.parametrize("layout", list(layouts()), ids=repr)
def test_every_writer_namespace_is_looked_up_and_every_lookup_namespace_is_written(layout):
    written = {layout.writer_namespace(*r) for r in layout.ranks()}
    looked_up = layout.lookup_namespaces()
    assert len(set(looked_up)) == len(looked_up)
    assert written == set(looked_up)


@pytest.mark.parametrize(("tp", "heads"), [(3, 2), (8, 3), (6, 4)])
def test_heads_that_neither_divide_nor_multiply_tp_are_rejected(tp, heads):
    with pytest.raises(ValueError, match="num_kv_heads"):
        mk.ParallelLayout(tp_size=tp, num_kv_heads=heads)
    mk.ParallelLayout(tp_size=tp, num_kv_heads=heads, use_mla=True)  # MLA: one shared head


def test_put_step_and_writer_namespace():
    lay = mk.ParallelLayout(tp_size=8, num_kv_heads=2)
    assert lay.put_step == 4
    assert [lay.writer_namespace(t)[0] for t in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert mk.ParallelLayout(tp_size=4, dcp_size=4, use_mla=True).put_step == 1  # vLLM #45371
    with pytest.raises(ValueError, match="tp_rank"):
        lay.writer_namespace(8)
    with pytest.raises(TypeError, match="pp_rank"):
        lay.writer_namespace(0, 0, 0, "0")
