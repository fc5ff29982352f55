"""What other tests use of engine/test_telemetry.py, kept here so that no test module imports
another: Otel."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


@dataclass
class Otel:
    """One engine's SDK: its spans in memory, its metrics read on demand."""

    spans: InMemorySpanExporter
    reader: InMemoryMetricReader
    tracer_provider: TracerProvider
    meter_provider: MeterProvider

    @classmethod
    def make(cls) -> Otel:
        spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
        tracer_provider = TracerProvider(shutdown_on_exit=False)
        tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
        meter_provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
        return cls(spans, reader, tracer_provider, meter_provider)

    def providers(self) -> dict[str, Any]:
        return {"tracer_provider": self.tracer_provider, "meter_provider": self.meter_provider}

    def finished(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.name == name]

    async def span(self, name: str, count: int = 1) -> list[ReadableSpan]:
        """The first ``count`` ended spans named ``name``, once they are exported (an
        execution's span ends just after its terminal state commits)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while len(found := self.finished(name)) < count:
            if loop.time() > deadline:
                raise AssertionError(f"{count} spans {name!r} never ended: {found}")
            await asyncio.sleep(0.01)
        return found[:count]

    def metrics(self) -> dict[str, Any]:
        data = self.reader.get_metrics_data()
        assert data is not None
        return {
            metric.name: metric
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
        }

    def total(self, name: str, **attributes: str) -> float:
        """The sum of a counter's points whose attributes include ``attributes``."""
        metric = self.metrics().get(name)
        if metric is None:
            return 0
        return sum(
            point.value
            for point in metric.data.data_points
            if all(point.attributes.get(f"delegation.{k}") == v for k, v in attributes.items())
        )

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()
