"""Layer 1, the wire protocol: messages, their codec, subjects, error codes and the control
transition table. Imports nothing else of dpcoord, so every other layer may use it."""

PROTOCOL_VERSION = 1
