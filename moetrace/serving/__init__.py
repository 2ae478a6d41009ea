"""Serving: the placement's router run in front of real engines (docs/serving.md).

``router`` is the library router (``ExpertRouter``): loaded from a placement file, it picks the node
and data-parallel rank of each request from its prefill routed experts, with live per-rank load,
thread-safe. ``ray_serve`` is its Ray Serve plug-in (a ``RequestRouter`` loaded by class path); it
imports Ray, so nothing here imports it: name it in Ray Serve's config. ``proxy`` is the
prefill–decode proxy (``moetrace route serve``) over ``engines`` (vLLM / SGLang wire formats),
``http11`` (asyncio HTTP/1.1), ``metrics`` (Prometheus text); ``standin`` serves stand-in engines.

Layer (docs/architecture.md): above ``placement`` (it reads placement files and routes through
``placement.routers``), below ``cli``.
"""

from __future__ import annotations

from moetrace.serving.router import Decision, ExpertRouter, RoutingError, expert_counts

__all__ = ["Decision", "ExpertRouter", "RoutingError", "expert_counts"]
