"""The proxy's Prometheus metrics (``prometheus-client``), served at ``/metrics``.

=====================================================  ===========================================================
metric                                                 meaning
=====================================================  ===========================================================
``fedroute_proxy_requests_total{route,status}``        chat requests by ``route`` (``routed``, ``passthrough``,
                                                       ``invalid``: refused by the proxy before any upstream
                                                       call, e.g. a malformed ``fedroute:...`` model string)
                                                       and HTTP status
``fedroute_proxy_choices_total{model}``                routed requests per model ranked first (the router's choice)
``fedroute_proxy_answers_total{model,route}``          answered calls per model that answered (after fallbacks)
``fedroute_proxy_fallbacks_total{model,reason}``       failed tries per model and reason (``timeout``,
                                                       ``connection``, ``rate_limit``, ``server_error``,
                                                       ``client_error``)
``fedroute_proxy_spend_usd_total{model}``              observed spend, USD (price x usage tokens)
``fedroute_proxy_unpriced_answers_total{model}``       answers without ``usage`` (cost not observed)
``fedroute_proxy_routing_seconds``                     routing latency (embed + score + rank), histogram
``fedroute_proxy_upstream_seconds{model}``             latency of the answering call, histogram
``fedroute_proxy_feedback_total{result}``              scores received (``recorded``, ``unknown``, ``invalid``, ``error``)
=====================================================  ===========================================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from sdk.routed_chat import CallOutcome, ChatObserver, FailedAttempt, Plan

_ROUTING_BUCKETS = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024)
_UPSTREAM_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ProxyMetrics(ChatObserver):
    """The metrics of one proxy, in their own ``registry`` (a fresh ``CollectorRegistry`` by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("fedroute_proxy_requests", "chat completion requests", ["route", "status"], registry=r)
        self.choices = Counter("fedroute_proxy_choices", "routed requests per model ranked first", ["model"], registry=r)
        self.answers = Counter("fedroute_proxy_answers", "answered calls per model", ["model", "route"], registry=r)
        self.fallbacks = Counter("fedroute_proxy_fallbacks", "failed upstream tries", ["model", "reason"], registry=r)
        self.spend = Counter("fedroute_proxy_spend_usd", "observed spend in USD (price x usage tokens)", ["model"],
                             registry=r)
        self.unpriced = Counter("fedroute_proxy_unpriced_answers", "answers without usage", ["model"], registry=r)
        self.routing = Histogram("fedroute_proxy_routing_seconds", "routing latency (embed, score, rank)",
                                 buckets=_ROUTING_BUCKETS, registry=r)
        self.upstream = Histogram("fedroute_proxy_upstream_seconds", "latency of the answering upstream call",
                                  ["model"], buckets=_UPSTREAM_BUCKETS, registry=r)
        self.feedback = Counter("fedroute_proxy_feedback", "scores received", ["result"], registry=r)

    def routed(self, plan: Plan) -> None:
        self.choices.labels(plan.order[0]).inc()
        self.routing.observe(plan.routing_ms / 1e3)

    def failed(self, attempt: FailedAttempt) -> None:
        self.fallbacks.labels(attempt.model, attempt.kind).inc()

    def answered(self, outcome: CallOutcome) -> None:
        model = outcome.route.model
        self.answers.labels(model, "routed" if outcome.route.plan is not None else "passthrough").inc()
        self.upstream.labels(model).observe(outcome.latency_ms / 1e3)
        if outcome.cost_usd is None:
            self.unpriced.labels(model).inc()
        else:
            self.spend.labels(model).inc(outcome.cost_usd)
