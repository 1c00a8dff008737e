"""Layer 3, operations: settings, metrics, HTTP probes, the NATS Services API, log limiting
and process tuning. Shared by every role; knows none of them."""
