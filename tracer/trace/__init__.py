"""``moetrace.tracer.trace``: the stored formats, trace format v1 (docs/trace-format.md) and the load profile.

- ``schema``: the one explicit Arrow schema, ``ModelInfo``, the manifest header
- ``layout``: the file names of a trace directory
- ``writer``: ``TraceWriter``, the one crash-safe writer every producer uses
- ``parquet_encoder``: how the writer encodes routing parts (fast, or plain pyarrow: ``MOETRACE_PARQUET_ENCODER``)
- ``reader``: ``open_trace`` → ``Trace`` (polars frames, numpy ``TokenArrays``)
- ``checks``: the data checks the reader and ``validate`` share (columns, requests, routing rows)
- ``validate``: every invariant of the format, each problem named
- ``merge``: the manifest of a sharded trace from its shard manifests
- ``summary``: the text ``moetrace info`` prints
- ``profile``: the load profile (expert counts per stage, MoE layer, expert; docs/profile.md)

It imports no producer (backends, datasets, synth, import), so the format can be read without any
collector installed. The common names are re-exported here::

    from moetrace.tracer.trace import open_trace, TraceWriter, ModelInfo
"""

from moetrace.tracer.trace.layout import MANIFEST, REQUESTS_DIR, ROUTING_DIR, read_manifest
from moetrace.tracer.trace.reader import TokenArrays, Trace, open_trace
from moetrace.tracer.trace.schema import FORMAT, NO_EXPERT, STAGE_DECODE, STAGE_PREFILL, VERSION, ModelInfo
from moetrace.tracer.trace.writer import OnExisting, TraceWriter, WriterStats

__all__ = [
    "FORMAT",
    "VERSION",
    "NO_EXPERT",
    "STAGE_PREFILL",
    "STAGE_DECODE",
    "ModelInfo",
    "MANIFEST",
    "REQUESTS_DIR",
    "ROUTING_DIR",
    "read_manifest",
    "Trace",
    "TokenArrays",
    "open_trace",
    "TraceWriter",
    "WriterStats",
    "OnExisting",
]
