"""scheduler_lib: ordered, durable, observable batch scheduling on a Service-Broker-style
message broker."""

__version__ = "0.1.0"
