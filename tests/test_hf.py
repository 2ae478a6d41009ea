"""HF backend: recorded experts are the model's own routing decision, attributed exactly.

Real forward passes of the -tiny presets (real architecture classes, seeded random weights).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetrace.tracer.backends.hf import RoutingRecorder, _iter_routers, build_tiny_model, generate_batch, tiny_tokenizer

ARCHS = [
    "deepseek-v3-tiny",
    "qwen3-30b-a3b-tiny",
    "mixtral-8x7b-tiny",
    "olmoe-1b-7b-tiny",
    "llama4-maverick-tiny",
    "gpt-oss-120b-tiny",
]
TEXTS = [
    "Natalia sold clips to 48 of her friends in April.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize: the river rose overnight and the bridge was closed.",
    "hi",
    "What is the derivative of x^3 + 2x?",
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)  # as `collect` does for -tiny models on a CPU
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = build_tiny_model(name, seed=0)
        return cache[name]

    return get


def _reference_topk(router, h, info):
    """The routing rule of each architecture, written out here independently of transformers."""
    h = h.reshape(-1, h.shape[-1]).float()
    K = info.top_k
    logits = h @ router.weight.float().T
    if getattr(router, "bias", None) is not None and router.bias is not None:
        logits = logits + router.bias.float()
    if hasattr(router, "e_score_correction_bias"):  # DeepSeek-V3: sigmoid + bias, group-limited
        G, TG = info.n_group, info.topk_group
        s = logits.sigmoid() + router.e_score_correction_bias.float()
        per_group = s.view(-1, G, info.num_experts // G)
        group_score = per_group.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(TG, dim=-1).indices, 1.0)
        s = s.masked_fill(~keep.repeat_interleave(info.num_experts // G, dim=1).bool(), float("-inf"))
        return s.topk(K, dim=-1).indices
    return logits.topk(K, dim=-1).indices


@pytest.mark.parametrize("name", ARCHS)
def test_recorded_experts_are_the_routers_decision(name, models, tok):
    model, info = models(name)
    routers = [r for _, r in _iter_routers(model)]
    inputs: list[torch.Tensor] = []
    handles = [r.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach().clone())) for r in routers]
    ids = torch.tensor([tok.encode(TEXTS[0] + " " + TEXTS[1])])
    try:
        with RoutingRecorder(model, info) as rec, torch.inference_mode():
            model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    assert rec.num_forwards == 1 and len(inputs) == info.num_moe_layers
    mismatched = 0
    for l, router in enumerate(routers):
        with torch.no_grad():
            got = rec.ids[l][0].sort(-1).values
            ref = _reference_topk(router, inputs[l], info).sort(-1).values
            mismatched += int((got != ref).any(-1).sum())
            # the model's own router module, re-run on the captured hidden states
            again = router(inputs[l])
            again_ids = again[2] if len(again) == 3 else again[0].topk(info.top_k, dim=-1).indices
            assert torch.equal(again_ids.sort(-1).values, got)
    assert mismatched == 0


def test_deepseek_routing_is_not_a_plain_topk(models, tok):
    """Group-limited, bias-corrected selection: a top-k of the raw scores would be wrong."""
    model, info = models("deepseek-v3-tiny")
    ids = torch.tensor([tok.encode(" ".join(TEXTS))])
    logits_in: list[torch.Tensor] = []
    routers = [r for _, r in _iter_routers(model)]
    hs = [r.register_forward_hook(lambda m, a, o: logits_in.append(o[0])) for r in routers]
    try:
        with RoutingRecorder(model, info) as rec, torch.inference_mode():
            model(input_ids=ids)
    finally:
        for h in hs:
            h.remove()
    differs = 0
    for l in range(info.num_moe_layers):
        got = rec.ids[l][0]
        naive = logits_in[l].sigmoid().topk(info.top_k, dim=-1).indices
        differs += int((got.sort(-1).values != naive.sort(-1).values).any(-1).sum())
        groups = got // (info.num_experts // info.n_group)
        n_groups_used = torch.tensor([len(set(g.tolist())) for g in groups])
        assert int(n_groups_used.max()) <= info.topk_group
    assert differs > 0


@pytest.mark.parametrize("name", ["deepseek-v3-tiny", "llama4-maverick-tiny", "gpt-oss-120b-tiny"])
def test_batched_equals_batch_size_one(name, models, tok):
    """Batching (left padding, finished requests padded) attributes every token exactly.

    Rows are identical; expert sets may differ only at numerical near-ties of the router, which are
    counted (and, on these models, are zero).
    """
    model, info = models(name)
    prompts = [tok.encode(t) for t in TEXTS]
    batched = generate_batch(model, tok, prompts, info=info, max_new_tokens=10)
    near_ties = 0
    for p, b in zip(prompts, batched):
        single = generate_batch(model, tok, [p], info=info, max_new_tokens=10)[0]
        assert (b.prompt_tokens, b.output_tokens) == (single.prompt_tokens, single.output_tokens) == (len(p), 10)
        assert b.output_ids == single.output_ids
        K = info.top_k
        bs = np.sort(b.topk_ids_TX.reshape(-1, info.num_moe_layers, K), -1)
        ss = np.sort(single.topk_ids_TX.reshape(-1, info.num_moe_layers, K), -1)
        near_ties += int((bs != ss).any(-1).sum())
        assert (b.topk_ids_TX[-1] == -1).all() and (b.topk_ids_TX[:-1] >= 0).all()
    total = sum(b.topk_ids_TX.shape[0] for b in batched) * info.num_moe_layers
    print(f"{name}: {near_ties} of {total} (token, layer) routings differ between batch 5 and batch 1")
    assert near_ties <= 0.01 * total


def test_finished_requests_stop_being_recorded(models, tok):
    """A request that hits EOS while others continue gets no rows for the pads fed after it."""
    model, info = models("olmoe-1b-7b-tiny")
    prompts = [tok.encode(t) for t in TEXTS[:3]]
    free = generate_batch(model, tok, prompts, info=info, max_new_tokens=8)
    stop_tok = free[0].output_ids[2]  # make request 0 finish at its 3rd generated token
    old = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = stop_tok
    try:
        res = generate_batch(model, tok, prompts, info=info, max_new_tokens=8)
        single = generate_batch(model, tok, prompts[:1], info=info, max_new_tokens=8)[0]
    finally:
        model.generation_config.eos_token_id = old
    r0 = res[0]
    first = r0.output_ids.index(stop_tok)
    assert r0.output_tokens == first + 1
    assert r0.topk_ids_TX.shape[0] == len(prompts[0]) + r0.output_tokens
    assert np.array_equal(r0.topk_ids_TX, single.topk_ids_TX)


def test_routing_weights_are_recorded_with_the_ids(models, tok):
    """DeepSeek-V3 renormalizes its top-8 weights and scales them by routed_scaling_factor (2.5)."""
    model, info = models("deepseek-v3-tiny")
    (r,) = generate_batch(model, tok, [tok.encode(TEXTS[1])], info=info, max_new_tokens=4, record_weights=True)
    w = r.topk_weights_TX.reshape(-1, info.num_moe_layers, info.top_k)
    assert w.shape[0] == r.topk_ids_TX.shape[0]
    assert np.allclose(w[:-1].sum(-1), 2.5, atol=1e-4)
    assert (w[-1] == 0).all()  # the last generated token has no routing


def test_hf_backend_through_collect_keeps_weights_and_text(tmp_path):
    """`collect(backend="hf")`: the one GenerationConfig's record_weights and store_text reach the trace."""
    from moetrace.tracer.collect import CollectConfig, collect
    from moetrace.tracer.trace.reader import open_trace
    from moetrace.tracer.trace.validate import find_problems

    config = CollectConfig(
        model="mixtral-8x7b-tiny",
        datasets=("chat",),
        num_requests=3,
        max_new_tokens=3,
        batch_size=2,
        record_weights=True,
        store_text=True,
    )
    result = collect(config, out=tmp_path / "t", backend="hf")
    assert result.backend == "hf" and result.num_new_requests == 3
    assert find_problems(tmp_path / "t") == []
    tr = open_trace(tmp_path / "t")
    assert tr.manifest["writer"]["with_weights"] and tr.manifest["writer"]["with_text"]
    assert all(tr.requests().collect()["output_text"].is_not_null())
    routing = tr.routing().collect()
    ids = np.array(routing["experts"].to_list()).reshape(-1, 32, 2)
    w = np.array(routing["weights"].to_list()).reshape(-1, 32, 2)
    fed = (ids >= 0).all(axis=(1, 2))  # every token but each request's last
    assert fed.sum() == routing.height - 3
    assert np.allclose(w[fed].sum(-1), 1.0, atol=1e-5)  # Mixtral renormalizes its top-2 weights


def test_hf_backend_refuses_a_cuda_device_without_a_gpu(tmp_path):
    from moetrace.errors import ModelError
    from moetrace.tracer.collect import CollectConfig, collect

    if torch.cuda.device_count() > 0:
        pytest.skip("a GPU is visible here; this checks the message without one")
    config = CollectConfig(model="mixtral-8x7b-tiny", datasets=("chat",), num_requests=1, device="cuda")
    with pytest.raises(ModelError, match="--device cuda: no CUDA GPU is visible"):
        collect(config, out=tmp_path / "t", backend="hf")
    assert not (tmp_path / "t").exists()
