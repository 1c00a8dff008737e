"""Engine runtime on NATS and the model backends it drives.

``engines.backend`` defines the backend interface; ``engines.echo`` is the protocol test
double; the torch backend is imported only when selected.
"""
