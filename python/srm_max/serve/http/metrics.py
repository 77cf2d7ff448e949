"""The server's Prometheus metrics, on a registry of its own (so several servers in one
process, as in the tests, do not share counters).

Counts of running and waiting requests and the slot occupancy are read from the
engine loop when scraped, so they are exact at that moment.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (the /metrics media type)

# latency buckets from 1 ms (a tiny model's step) to a minute (a long queue on a CPU)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("srm_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("srm_prompt_tokens", "Prompt tokens of the samples started", registry=r)
        self.prompts_prefilled = Counter("srm_prompts_prefilled", "Prompts run through prefill (the samples of "
                                         "one prompt that start together share one)", registry=r)
        self.prefix_cache_hits = Counter("srm_prefix_cache_hits", "Prompts prefilled from a cached prefix's state",
                                         registry=r)
        self.prefix_cache_tokens_saved = Counter("srm_prefix_cache_tokens_saved", "Prompt tokens not prefilled: "
                                                 "covered by a cached prefix's state", registry=r)
        self.prefix_cache_bytes = Gauge("srm_prefix_cache_bytes", "Bytes held by the prefix cache's entries "
                                        "(0 when it is off or the model cannot use it)", registry=r)
        self.generated_tokens = Counter("srm_generated_tokens", "Tokens generated", registry=r)
        self.samples_finished = Counter("srm_samples_finished", "Samples finished, by reason "
                                        "(stop, length, context, cancelled)", ["reason"], registry=r)
        self.disconnects = Counter("srm_client_disconnects", "Requests whose client went away "
                                   "before the answer was complete", registry=r)
        self.engine_calls = Counter("srm_engine_calls", "Engine calls, by kind (prefill, decode)",
                                    ["kind"], registry=r)
        self.running = Gauge("srm_running_requests", "Requests with a sample in a slot", registry=r)
        self.waiting = Gauge("srm_waiting_requests", "Requests admitted whose samples all wait for a slot",
                             registry=r)
        self.waiting_samples = Gauge("srm_waiting_samples", "Samples waiting for a slot", registry=r)
        self.slots = Gauge("srm_slots", "Slots of the engine loop (the most samples decoded together)",
                           registry=r)
        self.slots_busy = Gauge("srm_slots_busy", "Slots running a sample", registry=r)
        self.occupancy = Gauge("srm_slot_occupancy", "Busy slots / slots", registry=r)
        self.ttft = Histogram("srm_time_to_first_token_seconds", "From admission to a request's first "
                              "token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("srm_inter_token_latency_seconds", "Time per token of a running sample, "
                             "one observation per engine call that gave it tokens", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self._snapshot: Callable[[], dict] | None = None

    def watch(self, snapshot: Callable[[], dict]) -> None:
        """Read the loop's gauges (running, waiting, waiting_samples, slots, busy) from
        ``snapshot()`` when scraped: once per scrape, so that they agree with each other."""
        self._snapshot = snapshot

    def watch_prefix_cache(self, cache) -> None:
        """Read ``srm_prefix_cache_bytes`` from ``cache`` (a PrefixCache, or None: off)."""
        self.prefix_cache_bytes.set_function(lambda: float(cache.bytes if cache is not None else 0))

    def render(self) -> bytes:
        if self._snapshot is not None:
            s = self._snapshot()
            for gauge, value in ((self.running, s["running"]), (self.waiting, s["waiting"]),
                                 (self.waiting_samples, s["waiting_samples"]), (self.slots, s["slots"]),
                                 (self.slots_busy, s["busy"]), (self.occupancy, s["busy"] / max(1, s["slots"]))):
                gauge.set(value)
        return generate_latest(self.registry)
