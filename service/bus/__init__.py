"""Layer 2, NATS plumbing: connecting, direct subscriptions on the reading task, the embedded
server, publish refusals, and the splitter that keeps batches under ``max_payload``."""
