"""The SRM's graphs: prefill, which also scores (chunked parallel form), and decode (recurrent form).

Builders take the config and the weight schema (``srm_max.models.srm.schema``) they
are handed, and the path of the Mojo kernel library when they use its ops.
"""

from .decode import build_decode_graph, build_decode_steps_graph
from .prefill import CHUNK, build_prefill_graph

__all__ = ["CHUNK", "build_decode_graph", "build_decode_steps_graph", "build_prefill_graph"]
