"""The joint placer's GPUs laid out by expected MoE-layer time, expert reads included (``expert_layout``)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moetrace.placement.cost import ExpertCompute, Link, Links
from moetrace.placement.expert_layout import choose_layouts, expert_seconds_LGE, layer_moe_seconds
from moetrace.placement.joint import members_of_placement
from moetrace.placement.maps import placement_from_phy2log

LINKS = Links(intra=Link(bytes_per_s=450e9, latency_s=0.0), inter=Link(bytes_per_s=50e9, latency_s=0.0))
#: Llama-4-Maverick's routed expert (hidden 5120, FFN 8192, BF16): 252 MB read per activated expert
BIG = ExpertCompute(hidden_size=5120, ffn_size=8192)
COPY_BYTES = 5120 * 3.0


def _members(phy2log_LP: np.ndarray, G: int, E: int) -> np.ndarray:
    return members_of_placement(placement_from_phy2log(phy2log_LP, num_experts=E), num_groups=G, num_experts=E)


def test_popular_experts_stacked_on_one_gpu_are_spread_when_reads_dominate():
    """One node of 2 GPUs, 2 slots each: experts 0 and 1 take nearly every token. Stacked on GPU 0 it
    reads both every step; spread, each GPU reads about one: the layout changes, the node's experts do not."""
    G, E = 1, 4
    phy = np.array([[0, 1, 2, 3]])
    usage = np.array([[[50.0, 50.0, 0.1, 0.1]]])  # [G, L, E]
    member = _members(phy, G, E)
    out, changed = choose_layouts(
        phy, member, usage, ranks_per_group=2, links=LINKS, expert=BIG, copies_per_step=64, copy_bytes=COPY_BYTES
    )
    assert changed == 1
    assert {frozenset(out[0, :2]), frozenset(out[0, 2:])} == {frozenset({0, 2}), frozenset({1, 3})} or {
        frozenset(out[0, :2]),
        frozenset(out[0, 2:]),
    } == {frozenset({0, 3}), frozenset({1, 2})}
    sec = expert_seconds_LGE(member, usage, copies_per_step=64, expert=BIG)[0]
    u = usage[:, 0, :] * 64 / usage.sum()
    kw = dict(num_ranks=2, links=LINKS, copy_scale=COPY_BYTES)
    assert layer_moe_seconds(out[0], u, sec, **kw) < layer_moe_seconds(phy[0], u, sec, **kw)


def test_when_every_expert_is_read_every_step_the_link_layout_stays():
    """A batch that activates every expert, still memory-bound (about 250 tokens each, under the ~300 at
    which computing beats reading a 252 MB expert): expert time is the same for every layout, nothing moves."""
    G, E = 2, 8
    rng = np.random.default_rng(0)
    phy = np.array([rng.permutation(E)])
    usage = rng.uniform(1, 1.2, size=(G, 1, E))
    member = _members(phy, G, E)
    out, changed = choose_layouts(
        phy, member, usage, ranks_per_group=2, links=LINKS, expert=BIG, copies_per_step=2000, copy_bytes=COPY_BYTES
    )
    assert changed == 0 and np.array_equal(out, phy)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    G=st.sampled_from([1, 2, 4]),
    wn=st.sampled_from([1, 2, 4]),
    per=st.sampled_from([1, 2]),
)
def test_layouts_keep_nodes_and_copies_and_never_raise_the_expected_time(seed, G, wn, per):
    rng = np.random.default_rng(seed)
    L, W = 3, G * wn
    P = W * per
    J = P // G
    E = P - int(rng.integers(0, J)) if G > 1 else P  # some redundant slots, on other nodes than their expert's

    def layer() -> np.ndarray:  # each node J distinct experts, every expert somewhere (as the membership LP gives)
        nodes = [list(c) for c in np.array_split(rng.permutation(E), G)]
        for g in range(G):
            spare = [e for e in rng.permutation(E) if e not in nodes[g]]
            nodes[g] += spare[: J - len(nodes[g])]
        return np.concatenate([rng.permutation(n) for n in nodes])

    phy = np.stack([layer() for _ in range(L)])
    usage = rng.gamma(0.5, 1.0, size=(G, L, E)) + 1e-3
    member = _members(phy, G, E)
    copies = float(rng.choice([4, 64, 1024]))
    out, _ = choose_layouts(
        phy, member, usage, ranks_per_group=wn, links=LINKS, expert=BIG, copies_per_step=copies, copy_bytes=COPY_BYTES
    )
    assert np.array_equal(_members(out, G, E), member)  # every node keeps its experts: routing unchanged
    for l in range(L):
        assert np.array_equal(np.bincount(out[l], minlength=E), np.bincount(phy[l], minlength=E))
        sec = expert_seconds_LGE(member, usage, copies_per_step=copies, expert=BIG)[l]
        u = usage[:, l, :] * copies / usage[:, l, :].sum()
        kw = dict(num_ranks=W, links=LINKS, copy_scale=COPY_BYTES)
        assert layer_moe_seconds(out[l], u, sec, **kw) <= layer_moe_seconds(phy[l], u, sec, **kw) + 1e-15
